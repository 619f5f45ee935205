"""ONNX export of a checkpoint's eval-mode embedding model (what jobs/export.py runs).

The file holds the whole model of any method (frozen backbone, adapters, prompt pool, prompts,
LoRA, head) with a dynamic batch size: input ``images`` float32 (B, 3, S, S), the eval view
normalised; output ``embeddings`` float32 (B, E), L2-normalised. Its metadata (``custom_metadata_map``
in ONNX Runtime) says how to make the input and what the output belongs to:

    puma.model_id       the model id an index records (puma.checkpoint.checkpoint_id)
    puma.method         model.method
    puma.img_size       S;  puma.resize_shorter: the shorter side before the center crop
    puma.mean, puma.std JSON lists: (x / 255 - mean) / std per channel
    puma.embed_dim      E
    puma.view           how the eval view is made, in words
    puma.precision      fp32, or int8 for ``quantize_int8``'s copy

``quantize_int8`` makes a smaller copy with int8 weights (ONNX Runtime dynamic quantisation: weights
QInt8 per output channel, activations quantised per batch at run time; per channel rather than per
tensor was chosen on the demo's training images, docs/export.md). It is not parity checked: int8 costs
some accuracy (``jobs/export.py --int8`` prints its min cosine to the fp32 file on the probe images).

An export is checked before it is written: ONNX Runtime must give the PyTorch embeddings of a seeded
probe batch within cosine PARITY_COSINE per image, else ExportError. ``docs/export.md`` shows how
to run the file with onnxruntime, numpy and Pillow only.
"""

from __future__ import annotations

import io
import json
import tempfile
from dataclasses import asdict, dataclass

import numpy as np

from puma import storage
from puma.errors import UserError

OPSET = 17
PARITY_COSINE = 0.9999
PROBE_BATCH = 4
VIEW_TEXT = ("decode (JPEG at the DCT scale nearest above resize_shorter), EXIF upright, RGB; resize "
             "the shorter side to resize_shorter and center crop img_size (one bicubic resample of the crop "
             "box); (x / 255 - mean) / std; channels first")


class ExportError(UserError, RuntimeError):
    """An export that cannot be written as asked (e.g. ONNX Runtime disagrees with PyTorch)."""


@dataclass
class ExportReport:
    """What was written and how well it agrees with PyTorch."""

    out: str
    model_id: str
    method: str
    img_size: int
    embed_dim: int
    opset: int
    bytes: int
    parity_min_cosine: float

    def summary(self) -> str:
        return (f"{self.out}: {self.method}, {self.img_size} px -> {self.embed_dim}-d, opset {self.opset}, "
                f"{self.bytes / 1e6:.1f} MB; ONNX Runtime vs PyTorch min cosine {self.parity_min_cosine:.6f} "
                f"on {PROBE_BATCH} probe images; model {self.model_id}")


def export_onnx(checkpoint: str, out: str, backbone_weights: str | None = None,
                opset: int = OPSET) -> ExportReport:
    """Export the checkpoint's eval-mode model to ONNX at ``out`` (local or s3://), parity checked."""
    from puma.checkpoint import checkpoint_id, load_model, resolve_checkpoint

    checkpoint = resolve_checkpoint(checkpoint)
    model, cfg = load_model(checkpoint, backbone_weights)  # eval mode, probe verified
    size = cfg.model.backbone.img_size
    want = probe_embeddings(model, cfg)  # (B, E)
    model_id = checkpoint_id(checkpoint)  # hashes the weights: once
    data = onnx_bytes(model, cfg, model_id, opset)
    cosine = parity(data, _probe_images(size), want)
    if cosine < PARITY_COSINE:
        raise ExportError(f"ONNX Runtime embeds the probe images of {checkpoint} at cosine {cosine:.6f} to "
                          f"PyTorch (< {PARITY_COSINE}); not written. Report this with the checkpoint's "
                          f"method {cfg.model.method!r}")
    storage.write_bytes(out, data)
    return ExportReport(out, model_id, cfg.model.method, size, int(want.shape[1]), opset,
                        len(data), cosine)


def onnx_bytes(model, cfg, model_id: str = "", opset: int = OPSET) -> bytes:
    """The eval-mode ``model`` (built from ``cfg``) as ONNX bytes with its metadata (no parity check)."""
    import torch

    probe = _probe(cfg.model.backbone.img_size)
    with torch.inference_mode():
        embed_dim = int(model(probe[:1]).shape[1])
    return _with_metadata(_to_onnx(model, probe, opset), _metadata(cfg, model_id, embed_dim))


def _probe(size: int):
    """The seeded probe images as a tensor (for PyTorch); _probe_images as numpy (no torch import)."""
    import torch

    return torch.from_numpy(_probe_images(size))


def _probe_images(size: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.standard_normal((PROBE_BATCH, 3, size, size), np.float32)  # (P, 3, S, S)


def _to_onnx(model, probe, opset: int) -> bytes:
    import torch

    buffer = io.BytesIO()
    with torch.inference_mode():
        torch.onnx.export(model, (probe,), buffer, input_names=["images"], output_names=["embeddings"],
                          dynamic_axes={"images": {0: "batch"}, "embeddings": {0: "batch"}},
                          opset_version=opset, dynamo=False)
    return buffer.getvalue()


def _metadata(cfg, model_id: str, embed_dim: int) -> dict[str, str]:
    from puma.data.images import eval_resize_size, eval_view_spec

    view = eval_view_spec(cfg)
    return {"puma.model_id": model_id, "puma.method": cfg.model.method, "puma.img_size": str(view.img_size),
            "puma.resize_shorter": str(eval_resize_size(view.img_size)),
            "puma.mean": json.dumps([float(v) for v in view.mean]),
            "puma.std": json.dumps([float(v) for v in view.std]), "puma.embed_dim": str(embed_dim),
            "puma.view": VIEW_TEXT, "puma.precision": "fp32"}


def _with_metadata(data: bytes, metadata: dict[str, str]) -> bytes:
    """``data`` with ``metadata`` set in its metadata_props (existing keys replaced)."""
    import onnx

    proto = onnx.load_from_string(data)
    kept = [(e.key, e.value) for e in proto.metadata_props if e.key not in metadata]
    del proto.metadata_props[:]
    for key, value in [*kept, *metadata.items()]:
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    return proto.SerializeToString()


def quantize_int8(data: bytes) -> bytes:
    """An exported model with int8 weights (ONNX Runtime dynamic quantisation, per output channel, 7-bit
    range), its puma.* metadata kept and ``puma.precision`` set to int8.

    The weights use 7 of their 8 bits (``reduce_range``): on x86 CPUs without VNNI (AVX2 only, as many
    AMD EPYC and older Xeons) ONNX Runtime's u8 x s8 kernels add pairs of products in 16 bits, which
    saturate with full-range weights (the tiny test model's min cosine to fp32 fell to 0.89); 7-bit
    weights cannot saturate there and cost nothing measurable on VNNI CPUs."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    puma_meta = {e.key: e.value for e in onnx.load_from_string(data).metadata_props
                 if e.key.startswith("puma.")}
    with tempfile.TemporaryDirectory(prefix="puma-int8-") as tmp:
        src, dst = f"{tmp}/fp32.onnx", f"{tmp}/int8.onnx"
        with open(src, "wb") as f:
            f.write(data)
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8, per_channel=True, reduce_range=True)
        with open(dst, "rb") as f:
            quantized = f.read()
    return _with_metadata(quantized, {**puma_meta, "puma.precision": "int8"})


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest per-row cosine between embeddings a (N, E) and b (N, E)."""
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def int8_agreement(fp32: bytes, int8: bytes, size: int) -> float:
    """The int8 file's min cosine to the fp32 file on the seeded probe images of ``size`` px."""
    probe = _probe_images(size)
    return min_cosine(embed(session(int8), probe), embed(session(fp32), probe))


def parity(data: bytes, images: np.ndarray, want: np.ndarray) -> float:
    """The smallest per-image cosine between ONNX Runtime's embeddings of ``images`` and ``want``."""
    return min_cosine(embed(session(data), images), want)


def session(data: bytes, threads: int = 0):
    """An ONNX Runtime CPU session of an exported model (``threads`` 0: ONNX Runtime's default)."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ExportError("ONNX Runtime is not installed: pip install -e .[convert] (or onnxruntime)") \
            from exc
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def probe_embeddings(model, cfg) -> np.ndarray:
    """PyTorch's embeddings (PROBE_BATCH, E) of the seeded probe images: what an export must reproduce."""
    import torch

    with torch.inference_mode():
        return model(_probe(cfg.model.backbone.img_size)).float().numpy()


def matching_session(data: bytes, want: np.ndarray, threads: int = 0):
    """A session of ``data``, refused (ExportError) unless it embeds the probe images as ``want``
    (probe_embeddings of the model it was exported from): no PyTorch model needed here."""
    sess = session(data, threads)
    size = int(sess.get_inputs()[0].shape[-1])
    cosine = min_cosine(embed(sess, _probe_images(size)), want)
    if cosine < PARITY_COSINE:
        raise ExportError(f"ONNX Runtime embeds the probe images at cosine {cosine:.6f} to PyTorch "
                          f"(< {PARITY_COSINE}); use embed.runtime=torch")
    return sess


def embed(sess, images: np.ndarray) -> np.ndarray:
    """Eval views (B, 3, S, S) -> embeddings (B, E) with an ONNX Runtime session."""
    return sess.run(["embeddings"], {"images": np.ascontiguousarray(images, np.float32)})[0]


def metadata(sess) -> dict[str, str]:
    """The puma.* metadata of a session's model."""
    return dict(sess.get_modelmeta().custom_metadata_map)


def report_dict(report: ExportReport) -> dict:
    return asdict(report)
