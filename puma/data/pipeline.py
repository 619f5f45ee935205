"""Ray Data: stream prepared Parquet, decode, augment, batch (the only data module that imports ray).

    read_parquet(shards of the split)          one prepared root, local or s3:// (puma.storage)
      -> select rows          pyarrow, vectorised: datasets of data.datasets, the split's label ranges
                              (training: the data.shots_per_class images per class, puma/data/fewshot.py)
      -> shuffle              train only, per epoch: data.shuffle = global | block | local | none
                              (block: the shards' order and each read block's rows, in the read task)
      -> decode + view        PIL, num_cpus = data.num_decode_cpus per task (1: one task per CPU;
                              oversubscribed cores cost far more than they overlap); rejects leave
                              the stream
                              (data.decode_on=worker: plain JPEGs' headers only, the consumer decodes
                              them on its device: puma/data/device_views.py)
    numpy batches: image uint8 (B, 3, H, W) and view (the normalisation), label int64, dataset, role,
                   item_id
                   (data.decode_on=worker: the columns of puma/data/device_views.py; consumers call
                   device_views.batch_images either way)

Labels: the training stream carries global ids from ``global_label_map`` (unique across
datasets), and ``schema.UNLABELED`` for the rows of an unlabeled catalogue; evaluation streams
carry the label within each dataset (metrics key on (dataset, label)).

Per-epoch randomness: the shuffle uses ``RandomSeedConfig(seed, reseed_after_execution=True)``
and each item's augmentation RNG is seeded by (train.seed, execution index, item id); each epoch is
a new execution of the same Dataset, so epochs differ and a re-run with the same seed repeats them,
independent of batching and task retries. A resumed run's stream starts its execution index at the
epochs already completed (:func:`start_at_epoch`), so it continues the sequence.

Rejects: a decode task sends the items it rejects to one ``RejectLog`` actor per rejects file
(``data.rejects_uri``) before it returns; the actor keeps one row per item id, so a retried task
cannot duplicate a row and a failed task's rows are sent again by its retry. The file starts with
the prepare-time rejects (missing files) of the selected datasets and is rewritten on every new
reject: it lists every bad item the streams have met.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import ray.data
from ray.data import FileShuffleConfig, RandomSeedConfig

from puma import storage
from puma.data import schema
from puma.data.fewshot import select_shots
from puma.data.images import (
    ImageRejected,
    ViewSpec,
    item_rng,
    make_view_uint8,
    plan_worker_view,
    view_column,
    view_spec,
    worker_columns,
)
from puma.data.manifest import DataNotPreparedError, Manifest
from puma.data.reject_log import RejectLog, start_reject_log
from puma.data.rejects import Reject, read_rejects
from puma.data.splits import LabelMap, global_label_map, label_range
from puma.run_folder import RunFolder

__all__ = ["train_dataset", "eval_dataset", "read_rows", "global_label_map", "rejects_uri", "reject_log",
           "iter_options", "RejectLog"]

READ_COLUMNS = [schema.ITEM_ID, schema.DATASET, schema.LABEL, schema.SPLIT, schema.ROLE, schema.IMAGE,
                schema.SOURCE_PATH]


# ----------------------------------------------------------------------------- rejects


def rejects_uri(cfg) -> str:
    """``data.rejects_uri``, or <train.storage_path>/<train.run_name>/data_rejects.jsonl."""
    return storage.absolute(cfg.data.rejects_uri or RunFolder.of(cfg).data_rejects)


# (Ray job id, rejects uri) -> the RejectLog handle this process keeps for the job's lifetime
_REJECT_LOGS: dict[tuple[str, str], ray.actor.ActorHandle] = {}


def reject_log(cfg, manifest: Manifest):
    """The RejectLog actor for this config's rejects file (created once per file and Ray job).

    The process that creates it keeps its handle for the job's lifetime: a non-detached actor dies with
    its creator's last handle, so a Dataset that held the only one (a finished train stream) would take
    the actor, and the rejects it holds, with it while the next stream looked it up by name."""
    uri = rejects_uri(cfg)
    key = (ray.get_runtime_context().get_job_id(), uri)
    if key not in _REJECT_LOGS:
        names = set(manifest.select(cfg.data.datasets))
        initial = [r for r in read_rejects(manifest.rejects_uri) if r["dataset"] in names]
        _REJECT_LOGS[key] = start_reject_log("puma-rejects-", uri, initial)
    return _REJECT_LOGS[key]


# ----------------------------------------------------------------------------- reading


def read_rows(cfg, manifest: Manifest, split: str, block_shuffle_seed: int | None = None) -> ray.data.Dataset:
    """Encoded rows of ``split`` (train | val | test) for ``data.datasets``; val rows get role query.

    With ``block_shuffle_seed`` (data.shuffle=block) every execution reads the shards in a new order and
    permutes the rows of each block it reads (:func:`_block_permutation`), in the read task itself.
    """
    stored = schema.TEST if split == schema.TEST else schema.TRAIN
    ranges = {name: _bounds(label_range(manifest, name, split, cfg.data.val_fraction))
              for name in manifest.select(cfg.data.datasets)}
    paths = manifest.shard_uris(stored)
    if not paths:
        raise DataNotPreparedError(f"{manifest.uri} has no {stored} shards; re-run jobs/prepare_data.py")
    _check_shard_schema(paths[0])
    files = None if block_shuffle_seed is None else \
        FileShuffleConfig(block_shuffle_seed, reseed_after_execution=True)
    ds = _read_parquet(paths, storage.ray_filesystem(manifest.uri), read_blocks(cfg, len(paths)), files)
    ds = ds.select_columns(READ_COLUMNS)
    role = schema.QUERY if split == schema.VAL else None
    shots = _shots(cfg, manifest, ranges) if split == schema.TRAIN else None
    select = functools.partial(_select_rows, ranges=ranges, role=role,
                               shots=ray.put(shots) if shots is not None else None,
                               permute_seed=block_shuffle_seed)
    return ds.map_batches(select, batch_format="pyarrow", batch_size=None, num_cpus=cfg.data.num_decode_cpus)


def _shots(cfg, manifest: Manifest, ranges: Mapping[str, tuple[int, int]]) -> pa.Array | None:
    """The few-shot item ids of the training split (data.shots_per_class > 0), else None (every row)."""
    if cfg.data.shots_per_class <= 0:
        return None
    ids = select_shots(manifest, sorted(ranges), cfg.data.shots_per_class, cfg.data.shots_seed)
    return pa.array(sorted(ids), pa.string())


def count_rows(cfg, manifest: Manifest, split: str) -> int:
    """How many rows :func:`read_rows` yields for ``split`` (before decode-time rejects), for progress.

    A stored split read whole comes from the manifest's counts; a split of classes within the stored
    training split (data.val_fraction > 0) is counted from the shards' dataset and label columns.
    """
    names = manifest.select(cfg.data.datasets)
    stored = schema.TEST if split == schema.TEST else schema.TRAIN
    few = split == schema.TRAIN and cfg.data.shots_per_class > 0
    if split == schema.TEST or (split == schema.TRAIN and not cfg.data.val_fraction and not few):
        counts = [manifest.datasets[n].get("counts", {}).get(stored, {}) for n in names]
        return sum(int(c.get("images", 0)) for c in counts)
    ranges = {n: _bounds(label_range(manifest, n, split, cfg.data.val_fraction)) for n in names}
    shots = _shots(cfg, manifest, ranges) if few else None
    total = 0
    for uri in manifest.shard_uris(stored):
        fs, path = storage.resolve(uri)
        columns = [schema.ITEM_ID, schema.DATASET, schema.LABEL]
        total += len(_select_rows(pq.read_table(path, columns=columns, filesystem=fs), ranges, None, shots))
    return total


def read_blocks(cfg, shards: int) -> int:
    """Blocks to read ``shards`` Parquet files into: two per decode task the cluster runs at once, and at
    least two per shard (a shard holds up to 256 MiB of images: blocks stay within Ray's 128 MiB target).

    Left to itself Ray splits the read into blocks of about 1 MB: 5-10 photos of 1,000 px, 50 of the CUB
    sample. Each block is a decode task's input, so the tasks' fixed costs were paid every few rows, and
    the training stream's shuffle, which makes an object per (input block, output block) pair and keeps
    the input's block count, made 49 x 49 objects for 500 rows of large photos and cost more CPU than
    decoding them.
    """
    slots = float(ray.cluster_resources().get("CPU", 1.0)) / cfg.data.num_decode_cpus
    return max(2 * shards, 2 * math.ceil(slots))


def _read_parquet(paths: list[str], filesystem, num_blocks: int | None = None,
                  shuffle: FileShuffleConfig | None = None) -> ray.data.Dataset:
    """read_parquet over the manifest's explicit file list, through Ray's V1 Parquet reader.

    Ray 2.60's DataSourceV2 reader adds a ListFiles stage that cost 3-5 s per execution (per epoch)
    on small local datasets here, against 0.4-0.6 s for V1; the manifest already lists every file.
    """
    ctx = ray.data.DataContext.get_current()
    previous = ctx.use_datasource_v2
    ctx.use_datasource_v2 = False
    try:
        return ray.data.read_parquet(paths, filesystem=filesystem, override_num_blocks=num_blocks,
                                     shuffle=shuffle)
    finally:
        ctx.use_datasource_v2 = previous


def _check_shard_schema(uri: str) -> None:
    """Fail on the driver, naming the file, if a shard does not have the contract's schema."""
    fs, path = storage.resolve(uri)

    def _read():
        with fs.open_input_file(path) as f:
            return pq.read_schema(f)

    schema.check_schema(storage.call("reading", uri, _read), uri)


def _bounds(labels: range) -> tuple[int, int]:
    return labels.start, labels.stop


def _select_rows(table: pa.Table, ranges: Mapping[str, tuple[int, int]], role: str | None,
                 shots=None, permute_seed: int | None = None) -> pa.Table:
    """Rows whose (dataset, label) falls in the split's label range of a selected dataset (and, with
    ``shots``, the few-shot item ids: an array, or its Ray object ref), in this execution's order of
    the block with ``permute_seed``."""
    mask = pa.array(np.zeros(len(table), dtype=bool))
    for name, (start, stop) in ranges.items():
        labels = table[schema.LABEL]
        in_range = pc.and_(pc.greater_equal(labels, start), pc.less(labels, stop))
        hit = pc.and_(pc.equal(table[schema.DATASET], name), in_range)
        mask = pc.or_(mask, hit)
    if shots is not None:
        shots = ray.get(shots) if isinstance(shots, ray.ObjectRef) else shots
        mask = pc.and_(mask, pc.is_in(table[schema.ITEM_ID], value_set=shots))
    table = table.filter(mask)
    if role is not None:
        column = table.schema.get_field_index(schema.ROLE)
        table = table.set_column(column, schema.ROLE, pa.array([role] * len(table), pa.string()))
    if permute_seed is not None and len(table):
        table = table.take(_block_permutation(table, permute_seed))
    return table


def _block_permutation(table: pa.Table, seed: int) -> np.ndarray:
    """This execution's (epoch's) order of a block's rows, seeded by (seed, execution index, the block's
    first item id): the same on a retried task, different every epoch."""
    return item_rng(seed, _execution_index(), str(table[schema.ITEM_ID][0])).permutation(len(table))


# ----------------------------------------------------------------------------- decoding


def _execution_index() -> int:
    """How many times this Dataset has been executed before (the epoch, for a training stream)."""
    return int(getattr(ray.data.DataContext.get_current(), "_execution_idx", 0))


def _label_lookup(label_map: LabelMap) -> dict[str, np.ndarray]:
    """Per dataset, an array global_id[label] (-1 where a label has no global id)."""
    out: dict[str, np.ndarray] = {}
    for (name, label), gid in label_map.items():
        table = out.setdefault(name, np.full(0, -1, np.int64))
        if label >= len(table):
            table = np.concatenate([table, np.full(label + 1 - len(table), -1, np.int64)])
            out[name] = table
        table[label] = gid
    return out


def _global_labels(datasets: np.ndarray, labels: np.ndarray, lookup: Mapping[str, np.ndarray]) -> np.ndarray:
    out = np.empty(len(labels), np.int64)
    for i, (name, label) in enumerate(zip(datasets, labels, strict=True)):
        if label == schema.UNLABELED:  # an unlabeled catalogue's row: only label-free methods train on it
            out[i] = schema.UNLABELED
            continue
        table = lookup.get(str(name))
        gid = table[label] if table is not None and label < len(table) else -1
        if gid < 0:
            raise ValueError(f"({name}, {label}) is in the training stream but not in the label map; build "
                             "the map with the same data.datasets and data.val_fraction as the stream")
        out[i] = gid
    return out


def _decode_batch(batch: dict[str, np.ndarray], view: ViewSpec, lookup: Mapping[str, np.ndarray] | None,
                  log) -> dict[str, np.ndarray]:
    """Decode and view every row (or, data.decode_on=worker, plan the JPEGs' views); rejected rows go to
    the RejectLog and leave the batch."""
    epoch = _execution_index()
    outputs, keep, rejects = [], [], []
    for i, (item_id, data) in enumerate(zip(batch[schema.ITEM_ID], batch[schema.IMAGE], strict=True)):
        rng = item_rng(view.seed, epoch, str(item_id)) if view.train else None
        try:
            make = plan_worker_view if view.on_worker else make_view_uint8
            outputs.append(make(bytes(data), view, rng))  # uint8 (3, S, S) | WorkerPlan
            keep.append(i)
        except ImageRejected as exc:
            rejects.append(Reject(str(item_id), str(batch[schema.DATASET][i]), exc.reason, "decode",
                                  str(batch[schema.SOURCE_PATH][i]), str(batch[schema.SPLIT][i]),
                                  exc.detail).to_dict())
    if rejects:
        ray.get(log.record.remote(rejects))
    idx = np.asarray(keep, dtype=np.int64)
    labels = np.asarray(batch[schema.LABEL], np.int64)[idx]
    datasets = np.asarray(batch[schema.DATASET]).astype(str)[idx]
    if lookup is not None:
        labels = _global_labels(datasets, labels, lookup)
    images = worker_columns(outputs, view) if view.on_worker else \
        {schema.BATCH_IMAGE: _stack(outputs, view), schema.BATCH_VIEW: view_column(view, len(outputs))}
    return {**images, schema.LABEL: labels, schema.DATASET: datasets,
            schema.ROLE: np.asarray(batch[schema.ROLE]).astype(str)[idx],
            schema.ITEM_ID: np.asarray(batch[schema.ITEM_ID]).astype(str)[idx]}


def _stack(views: list[np.ndarray], view: ViewSpec) -> np.ndarray:
    size = view.img_size
    return np.stack(views) if views else np.zeros((0, 3, size, size), np.uint8)  # (B, 3, S, S)


def _decode(cfg, manifest: Manifest, rows: ray.data.Dataset, view: ViewSpec,
            label_map: LabelMap | None) -> ray.data.Dataset:
    fn = functools.partial(_decode_batch, view=view, lookup=_label_lookup(label_map) if label_map else None,
                           log=reject_log(cfg, manifest))
    return rows.map_batches(fn, batch_format="numpy", batch_size=cfg.data.decode_batch_size,
                            num_cpus=cfg.data.num_decode_cpus)


# ----------------------------------------------------------------------------- public datasets


def train_dataset(cfg, manifest: Manifest, label_map: LabelMap, mean: Sequence[float],
                  std: Sequence[float]) -> ray.data.Dataset:
    """The training stream: shuffled each epoch, augmented, labels from ``label_map`` (global ids); its
    first execution is epoch 1's (:func:`start_at_epoch` moves it)."""
    _check_label_map(cfg, manifest, label_map)
    block = cfg.data.shuffle == "block"
    rows = read_rows(cfg, manifest, schema.TRAIN, block_shuffle_seed=cfg.train.seed if block else None)
    seed = RandomSeedConfig(seed=cfg.train.seed, reseed_after_execution=True)
    if cfg.data.shuffle == "global":
        rows = rows.random_shuffle(seed=seed)
    elif cfg.data.shuffle == "local":
        rows = rows.randomize_block_order(seed=seed)
    return _decode(cfg, manifest, rows, view_spec(cfg, True, (mean, std)), label_map)


def start_at_epoch(ds: ray.data.Dataset, epoch: int) -> ray.data.Dataset:
    """``ds`` with its next execution drawing the shuffle and crops of the epoch after ``epoch`` completed
    ones (0: the first epoch's), so a resumed run's epoch e is the same as an uninterrupted run's.

    The execution index seeds every per-epoch draw (Ray's RandomSeedConfig, :func:`_execution_index`);
    it lives on the context that one pipeline's datasets share (a copy made by its read), so no other
    stream sees the change.
    """
    ds.context._execution_idx = epoch
    return ds


def _check_label_map(cfg, manifest: Manifest, label_map: LabelMap) -> None:
    """Every training class the stream can yield must have a global id."""
    missing = [(name, label) for name in manifest.select(cfg.data.datasets)
               for label in label_range(manifest, name, schema.TRAIN, cfg.data.val_fraction)
               if label != schema.UNLABELED and (name, label) not in label_map]
    if missing:
        raise ValueError(f"the label map lacks {len(missing)} training class(es) of the stream, "
                         f"e.g. {missing[:3]}; "
                         "build it with global_label_map(manifest, data.val_fraction, data.datasets)")


def eval_dataset(cfg, manifest: Manifest, split: str, mean: Sequence[float],
                 std: Sequence[float]) -> ray.data.Dataset:
    """An evaluation stream of ``split`` (test | val | train): eval view, labels within each dataset."""
    return _decode(cfg, manifest, read_rows(cfg, manifest, split), view_spec(cfg, False, (mean, std)), None)


def iter_options(cfg, epoch: int) -> dict:
    """Extra ``iter_batches`` arguments for a training consumer (a seeded local shuffle buffer)."""
    if cfg.data.shuffle != "local":
        return {}
    return {"local_shuffle_buffer_size": cfg.data.shuffle_buffer_rows,
            "local_shuffle_seed": cfg.train.seed + epoch}
