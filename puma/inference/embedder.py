"""The two stages of the embedding stream: read + decode (Ray tasks) and the model (Ray actors).

    references (pyarrow)  ->  read_and_decode: image bytes (a file, or rows of a Parquet shard),
                              eval view; rejects go to the RejectLog and leave the batch
                          ->  Embedder: the checkpoint's model, loaded once per actor, eval mode,
                              on a GPU when the actor has one
    numpy batches: item_id, embedding float32 (B, E), dataset, label, class_name, role, catalogue,
                   image_uri, image_row, metadata, stamp, fingerprint (sha256 of the bytes read)

Neither stage imports Ray; ``puma.inference.job`` wires them into a Ray Data pipeline.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa

from puma import storage
from puma.data import schema
from puma.data.columns import first_rows, take_rows
from puma.data.images import ImageRejected, ViewSpec, make_view, plan_worker_view, worker_columns
from puma.data.rejects import Reject
from puma.index.table import (
    CATALOGUE,
    CLASS_NAME,
    DATASET,
    EMBEDDING,
    FINGERPRINT,
    IMAGE_ROW,
    IMAGE_URI,
    ITEM_ID,
    LABEL,
    METADATA,
    ROLE,
    STAMP,
    read_rows,
)

IMAGE = schema.BATCH_IMAGE
META_COLUMNS = (ITEM_ID, DATASET, LABEL, CLASS_NAME, ROLE, CATALOGUE, IMAGE_URI, IMAGE_ROW, METADATA, STAMP,
                FINGERPRINT)
OUTPUT_COLUMNS = (ITEM_ID, EMBEDDING, *META_COLUMNS[1:])
STRING_COLUMNS = (DATASET, CLASS_NAME, ROLE, CATALOGUE, IMAGE_URI, METADATA, STAMP, FINGERPRINT)


def use_storage(cfg) -> None:
    """Configure this worker's storage layer unless it already has these settings. Equal settings are
    not enough: with the endpoint from the environment (AWS_ENDPOINT_URL), an unconfigured worker's
    defaults equal the driver's, and S3 in a worker still needs ``configure`` to have run."""
    if not storage.configured() or storage.current_config() != cfg:
        storage.configure(cfg)


def read_image_bytes(refs: pa.Table) -> list[bytes | Exception]:
    """The encoded bytes of every reference, in order; a missing file is its exception, not a failure."""
    out: list[bytes | Exception] = [b""] * len(refs)
    uris, rows = refs[IMAGE_URI].to_pylist(), refs[IMAGE_ROW].to_pylist()
    by_parquet: dict[str, list[int]] = defaultdict(list)
    for i, (uri, row) in enumerate(zip(uris, rows, strict=True)):
        if row < 0:
            try:
                out[i] = storage.read_bytes(uri)
            except FileNotFoundError as exc:
                out[i] = exc
        else:
            by_parquet[uri].append(i)
    for uri, idx in by_parquet.items():
        wanted = np.asarray([rows[i] for i in idx], dtype=np.int64)
        images = read_rows(uri, wanted, [schema.IMAGE])[schema.IMAGE].to_pylist()
        for i, data in zip(idx, images, strict=True):
            out[i] = data
    return out


def share_images(refs: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """(one reference per distinct image: the first row naming its image_uri and image_row, in order;
    for each row of ``refs``, the position of its image's reference). Rows sharing a photo (product
    variants) are read, decoded and embedded once."""
    first = first_rows(refs[IMAGE_URI], refs[IMAGE_ROW].to_numpy())  # (N,) each row's image's first row
    own = first == np.arange(len(first))
    if own.all():  # nothing shared
        return refs, np.arange(len(refs))
    position = np.cumsum(own) - 1  # an image's place among the images, at its first row
    return take_rows(refs, np.flatnonzero(own)), position[first]


def decode_refs(refs: pa.Table, view: ViewSpec) -> tuple[dict[str, np.ndarray], list[dict]]:
    """(numpy batch of the decodable references with their eval views, reject rows of the others);
    data.decode_on=worker: the plain JPEGs' views are planned, the Embedder decodes them on its device."""
    keep, images, rejects, prints = [], [], [], []
    for i, data in enumerate(read_image_bytes(refs)):
        try:
            if isinstance(data, Exception):
                raise ImageRejected("missing_file", str(data))
            if not data:
                raise ImageRejected("empty_file", "0 bytes")
            images.append((plan_worker_view if view.on_worker else make_view)(bytes(data), view))
            keep.append(i)
            prints.append(fingerprint(bytes(data)))
        except ImageRejected as exc:
            rejects.append(_reject_row(refs, i, exc))
    kept = refs.take(pa.array(keep, pa.int64()))
    where = kept.schema.get_field_index(FINGERPRINT)
    kept = kept.set_column(where, FINGERPRINT, pa.array(prints, pa.string()))
    batch = {c: kept[c].to_numpy(zero_copy_only=False) for c in META_COLUMNS}
    if view.on_worker:
        return {**batch, **worker_columns(images, view)}, rejects
    size = view.img_size
    batch[IMAGE] = np.stack(images) if images else np.zeros((0, 3, size, size), np.float32)  # (B, 3, S, S)
    return batch, rejects


def fingerprint(data: bytes) -> str:
    """The content fingerprint an index stores per item: ``sha256:<hex>`` of the image bytes."""
    return "sha256:" + storage.sha256(data)


def _reject_row(refs: pa.Table, i: int, exc: ImageRejected) -> dict:
    stage = "read" if exc.reason in ("missing_file", "empty_file") else "decode"
    stamp = str(refs[STAMP][i]) if STAMP in refs.column_names else ""
    return Reject(item_id=str(refs[ITEM_ID][i]), dataset=str(refs[DATASET][i]), reason=exc.reason,
                  stage=stage, source_path=str(refs[schema.SOURCE_PATH][i]), split=str(refs[schema.SPLIT][i]),
                  detail=exc.detail, stamp=stamp).to_dict()


def read_and_decode(refs: pa.Table, view: ViewSpec, storage_cfg, reject_log) -> dict[str, np.ndarray]:
    """Ray Data task: decode a block of references; rejects are recorded before the task returns."""
    use_storage(storage_cfg)
    batch, rejects = decode_refs(refs, view)
    if rejects:
        import ray

        ray.get(reject_log.record.remote(rejects))
    return batch


class Embedder:
    """Ray Data actor: loads the checkpoint's model once, then embeds batches of eval views.

    ``runtime``: ``torch`` (the model on the actor's device) or ``onnx`` (ONNX Runtime on CPU, from
    ``onnx_model``, the exported bytes (puma.export), or exported here when not given). Given the bytes
    and ``onnx_probe`` (the PyTorch embeddings of export's probe images, which the driver computed), an
    ONNX actor builds no PyTorch model: it checks its session against ``onnx_probe`` and starts in
    about a second."""

    def __init__(self, checkpoint: str, backbone_weights: str, storage_cfg, use_gpu: bool,
                 threads: int, runtime: str = "torch", onnx_model: bytes | None = None,
                 onnx_probe: np.ndarray | None = None) -> None:
        use_storage(storage_cfg)
        self.onnx, self.onnx_model, self.onnx_probe, self.model = None, onnx_model, onnx_probe, None
        self.device = "cpu"
        if runtime == "onnx" and onnx_model is not None and onnx_probe is not None:
            from puma.export import matching_session

            # no PyTorch import at all: an actor process starts about a second sooner
            self.onnx = matching_session(onnx_model, onnx_probe, threads=max(0, threads))
            self.dim = int(onnx_probe.shape[1])
            return
        import torch

        from puma.checkpoint import load_model

        if threads > 0:  # 0: leave torch's threads as they are (the job's own process)
            torch.set_num_threads(threads)

        model, cfg = load_model(checkpoint, backbone_weights or None)  # eval mode, probe verified
        if runtime == "onnx":
            from puma.export import matching_session, onnx_bytes, probe_embeddings

            self.onnx_model = onnx_model or onnx_bytes(model, cfg)
            self.onnx_probe = probe_embeddings(model, cfg)
            self.onnx = matching_session(self.onnx_model, self.onnx_probe, threads=max(0, threads))
            use_gpu = False  # ONNX Runtime here runs on CPU
        self.device = torch.device("cuda" if use_gpu and torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device)
        self.dim = int(self.forward(np.zeros((1, 3, cfg.model.backbone.img_size,
                                               cfg.model.backbone.img_size), np.float32)).shape[1])

    def forward(self, images) -> np.ndarray:
        """Eval views (B, 3, S, S), numpy or a tensor on the actor's device -> embeddings (B, E) float32."""
        if self.onnx is not None:
            from puma.export import embed

            array = images if isinstance(images, np.ndarray) else images.cpu().numpy()
            return embed(self.onnx, array)  # (B, E)
        import torch

        with torch.inference_mode():
            if isinstance(images, np.ndarray):
                images = torch.from_numpy(np.array(images, np.float32)).to(self.device)  # writable copy
            return self.model(images).float().cpu().numpy()  # (B, E), L2-normalised by the head

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A batch of decode_refs (decoded here first, on the actor's device, with data.decode_on=worker)."""
        if len(batch[ITEM_ID]):
            emb = self.forward(self._views(batch))  # (B, E)
        else:
            emb = np.zeros((0, self.dim), np.float32)
        out = {c: batch[c] for c in META_COLUMNS}
        out[EMBEDDING] = emb
        return out

    def _views(self, batch: dict[str, np.ndarray]):
        """The batch's eval views (B, 3, S, S): the decode tasks' float32 views as they are for ONNX
        Runtime (no PyTorch import), else puma.data.device_views.batch_images on the actor's device."""
        images = batch.get(IMAGE)
        if self.onnx is not None and images is not None and images.dtype == np.float32:
            return images
        from puma.data.device_views import batch_images

        return batch_images(batch, self.device)


def to_table(batch: dict[str, np.ndarray]) -> pa.Table:
    """A numpy output batch as an embeddings table (embedding fixed_size_list<float32>[E])."""
    emb = np.ascontiguousarray(batch[EMBEDDING], np.float32)  # (B, E)
    columns = {ITEM_ID: pa.array(batch[ITEM_ID].astype(str), pa.string()),
               EMBEDDING: pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), emb.shape[1])}
    for c in STRING_COLUMNS:
        columns[c] = pa.array(batch[c].astype(str), pa.string())
    for c in (LABEL, IMAGE_ROW):
        columns[c] = pa.array(batch[c].astype(np.int64), pa.int64())
    return pa.table({c: columns[c] for c in OUTPUT_COLUMNS})
