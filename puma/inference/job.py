"""Batch embedding of catalogues into the sharded index: what ``jobs/embed.py`` runs.

    catalogue references (puma.inference.catalogue)        listed on the driver, no bytes read
      - already indexed, - listed rejects                   dropped BEFORE any read or decode
      -> Ray Data: read + decode + eval view (tasks, data.num_decode_cpus each)
      -> Embedder actors (embed.concurrency, model loaded once each, GPUs when present)
      -> driver: iter_batches, a commit every embed.commit_rows items (puma.index.add_items:
         shard files first, manifest last)

Exactly once: a crash loses at most the uncommitted block (and leaves at most an unfinished shard
folder, which the next write deletes); a re-run skips every committed item id, so it embeds only
the rest. One writer per index at a time.

Training: a new index is planned (puma.index.plan) for embed.expected_items or the first
catalogue's size. An exact (flat) index needs no training and is created with the first block.
An IVF index is trained once, before anything is added, on the embeddings of a seeded uniform
sample of plan.train_sample of the catalogue's items; those items are then committed first, so
nothing is embedded twice. Every later catalogue joins the same trained index.

Model id: ``puma.checkpoint.checkpoint_id``, the sha256 of the checkpoint's trainable weights, its
model config and its probe embeddings: the same model copied elsewhere keeps its id, and a
retrained ``best`` gets a new one, which the index refuses to mix with the old (build a new index
for a new model).

Rejects: ``<index>/rejects/<catalogue folder name>.jsonl`` (puma.data.rejects format; reasons
corrupt, truncated, tiny, too_large, missing_file, empty_file). A prepared catalogue's prepare-time
rejects (of the embedded splits) are listed there too, so the file names every bad item of the
catalogue. Listed items are not re-tried by later runs unless embed.retry_rejects is set.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from puma import console, storage
from puma.checkpoint import best_checkpoint_uri, checkpoint_id, load_model, read_checkpoint
from puma.checkpoint import resolve_checkpoint as follow_pointer
from puma.config import Config, absolute_paths
from puma.data.images import ViewSpec, eval_view_spec
from puma.data.manifest import load_manifest
from puma.data.rejects import read_rejects, reject_counts, write_rejects
from puma.errors import UserError
from puma.index import add_items, create_index, indexed_item_ids, plan_index, read_manifest
from puma.index.build import check_compatible
from puma.index.manifest import has_manifest
from puma.index.table import ITEM_ID, embedding_matrix
from puma.inference.catalogue import (
    SPLITS,
    CatalogueError,
    catalogue_name,
    catalogue_refs,
    check_unique,
    is_prepared,
    list_catalogues,
    without,
)
from puma.inference.embedder import Embedder, read_and_decode, to_table

log = logging.getLogger(__name__)
REJECTS_DIR = "rejects"


@dataclass
class EmbedReport:
    """What one catalogue's run did."""

    catalogue: str
    index_uri: str
    checkpoint: str = ""
    model_id: str = ""
    items: int = 0  # items the catalogue lists (the selected split)
    embedded: int = 0  # new items written to the index by this run
    skipped_indexed: int = 0  # already in the index: not read, not re-embedded
    skipped_rejected: int = 0  # listed in the rejects file by an earlier run: not re-tried
    rejected: int = 0  # items listed in the catalogue's rejects file after this run
    reject_reasons: dict = field(default_factory=dict)
    rejects_uri: str = ""
    ignored_files: int = 0  # non-image files under an image-folder catalogue
    shards_added: list[str] = field(default_factory=list)
    total: int = 0  # items in the index after this run
    seconds: float = 0.0
    error: str = ""  # watch: why this catalogue failed ('' when it did not)

    def summary(self) -> str:
        """One line for the job's output."""
        if self.error:
            return f"{self.catalogue}: FAILED: {self.error}"
        return (f"{self.catalogue}: embedded {self.embedded}, already indexed {self.skipped_indexed}, "
                f"rejected {self.rejected} {self.reject_reasons or ''}, "
                f"{len(self.shards_added)} shard(s) added, "
                f"index total {self.total} ({self.seconds:.1f} s)")


def resolve_checkpoint(cfg: Config, checkpoint: str | None = None) -> str:
    """``checkpoint``, else embed.checkpoint, else <train.storage_path>/<train.run_name>/best."""
    uri = checkpoint or cfg.embed.checkpoint or best_checkpoint_uri(cfg)
    return storage.absolute(uri)


def rejects_uri(index_uri: str, catalogue: str) -> str:
    """Where a catalogue's rejects are listed."""
    return storage.join(index_uri, REJECTS_DIR, f"{catalogue_name(catalogue)}.jsonl")


def embed_catalogue(cfg: Config, catalogue: str, *, index_uri: str | None = None,
                    checkpoint: str | None = None, split: str | None = None) -> EmbedReport:
    """Embed the catalogue's items that are not indexed yet and add them to the index.

    ``index_uri``, ``checkpoint`` and ``split`` default to index.uri, embed.checkpoint (see
    :func:`resolve_checkpoint`) and embed.split.
    """
    start = time.monotonic()
    cfg = absolute_paths(cfg)
    storage.configure(cfg.storage)
    run = _prepare_run(cfg, storage.absolute(catalogue), storage.absolute(index_uri or cfg.index.uri),
                       resolve_checkpoint(cfg, checkpoint))
    todo = _todo(run, split or cfg.embed.split)
    if len(todo):
        _check_model(run)
        _embed_todo(run, todo)
    _finish(run)
    run.report.seconds = time.monotonic() - start
    return run.report


def watch(cfg: Config, prefix: str) -> list[EmbedReport]:
    """Embed every catalogue (immediate sub-folder) under ``prefix`` that is not fully indexed yet.

    A catalogue that fails (bad layout, incompatible index) is reported with its error and the
    others still run.
    """
    cfg = absolute_paths(cfg)
    storage.configure(cfg.storage)
    reports = []
    for catalogue in list_catalogues(prefix):
        try:
            reports.append(embed_catalogue(cfg, catalogue))
        except UserError as exc:  # CatalogueError, IndexInputError, SchemaError, CheckpointError, ...
            log.error("catalogue %s failed: %s", catalogue, exc)
            reports.append(EmbedReport(catalogue=catalogue, index_uri=cfg.index.uri, error=str(exc)))
    return reports


# ----------------------------------------------------------------------------- the run


@dataclass
class _Run:
    """What one catalogue's run needs, resolved on the driver."""

    cfg: Config
    catalogue: str
    index_uri: str
    checkpoint: str
    model_id: str
    view: ViewSpec
    dim: int
    report: EmbedReport


def _prepare_run(cfg: Config, catalogue: str, index_uri: str, checkpoint: str) -> _Run:
    """The eval view and model id from the checkpoint (its own config), an empty report."""
    checkpoint = follow_pointer(checkpoint)  # best/ -> its version now: the id and all actors read one model
    state = read_checkpoint(checkpoint)
    model_cfg = state.config
    view = eval_view_spec(model_cfg, min_size=cfg.data.min_image_size)  # the model's view, the job's limit
    view = dataclasses.replace(view, on_worker=cfg.data.decode_on == "worker")  # and the job's decoder
    report = EmbedReport(catalogue=catalogue, index_uri=index_uri, checkpoint=checkpoint,
                         model_id=checkpoint_id(checkpoint, state),
                         rejects_uri=rejects_uri(index_uri, catalogue))
    return _Run(cfg, catalogue, index_uri, checkpoint, report.model_id, view, model_cfg.model.head.embed_dim,
                report)


def _check_model(run: _Run) -> None:
    """Load the checkpoint once on the driver with the backbone the actors will use: a model that does
    not reproduce its probe embeddings (another backbone, an edited file) is refused here in one line
    (a CheckpointError), not inside every actor's constructor, where Ray keeps only its text."""
    load_model(run.checkpoint, backbone_weights=run.cfg.embed.backbone_weights or None)


def _todo(run: _Run, split: str) -> pa.Table:
    """The catalogue's references minus what is indexed (and what earlier runs rejected)."""
    refs, run.report.ignored_files = catalogue_refs(run.catalogue, split)
    check_unique(refs, run.catalogue)
    _list_prepare_rejects(run, split)
    run.report.items = len(refs)
    if has_manifest(run.index_uri):
        manifest = read_manifest(run.index_uri)
        check_compatible(manifest, manifest.dim, run.model_id, run.index_uri)  # refuse another model early
        refs, run.report.skipped_indexed = without(refs, indexed_item_ids(run.index_uri, manifest))
    if not run.cfg.embed.retry_rejects:
        listed = pa.array([r["item_id"] for r in read_rejects(run.report.rejects_uri)], pa.string())
        refs, run.report.skipped_rejected = without(refs, listed)
    log.info("catalogue %s: %d item(s), %d to embed", run.catalogue, run.report.items, len(refs))
    return refs


def _list_prepare_rejects(run: _Run, split: str) -> None:
    """A prepared catalogue's prepare-time rejects of the embedded splits join the index's rejects file."""
    if not is_prepared(run.catalogue):
        return
    splits = SPLITS[split]
    found = [r for r in read_rejects(load_manifest(run.catalogue).rejects_uri)
             if r.get("split") in splits or split == "all"]
    if found:  # rows already listed keep their place (dumps keeps the first row of an item id)
        write_rejects(run.report.rejects_uri, [*read_rejects(run.report.rejects_uri), *found])


def _embed_todo(run: _Run, todo: pa.Table) -> None:
    """Train the index if it is new, then stream the rest in commits of embed.commit_rows."""
    import ray

    from puma.runtime import init_ray

    init_ray()
    reject_log = _reject_log(run)
    try:
        with console.progress(f"embedding {catalogue_name(run.catalogue)}", len(todo), "img") as bar:
            if not has_manifest(run.index_uri):
                todo = _create_index(run, todo, reject_log, bar)
            if len(todo):
                _commit_stream(run, _counted(_stream(run, todo, reject_log), bar))
    finally:
        ray.kill(reject_log)  # every decode task has recorded its rejects (ray.get) before returning


def _counted(batches: Iterator, bar: console.Progress) -> Iterator:
    """The batches, each counted on the progress display as it passes."""
    for batch in batches:
        bar.update(len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch))
        yield batch


def _create_index(run: _Run, todo: pa.Table, reject_log, bar: console.Progress) -> pa.Table:
    """IVF: embed a seeded sample, train on it and commit it; flat: created by the first commit."""
    expected = run.cfg.embed.expected_items or len(todo)
    plan = plan_index(run.cfg.index, expected, run.dim)
    log.info("new index %s: %s for %d items", run.index_uri, plan.factory, expected)
    if plan.index_type == "flat":
        return todo
    rows = np.sort(np.random.default_rng(run.cfg.index.seed).choice(
        len(todo), size=min(len(todo), plan.train_sample), replace=False))
    sample = todo.take(pa.array(rows))
    tables = [to_table(b) for b in _counted(_stream(run, sample, reject_log), bar)]
    table = pa.concat_tables(tables) if tables else None
    if table is None or len(table) == 0:
        raise CatalogueError(f"no image of the training sample of {run.catalogue} could be decoded; "
                             f"see {run.report.rejects_uri}")
    create_index(run.index_uri, run.cfg.index, embedding_matrix(table), expected_items=expected,
                 model_id=run.model_id)
    _commit_stream(run, iter([table]))
    return without(todo, sample[ITEM_ID].combine_chunks())[0]


def _stream(run: _Run, refs: pa.Table, reject_log) -> Iterator[dict[str, np.ndarray]]:
    """Embedded numpy batches of ``refs`` from the Ray Data pipeline (read, decode, embed)."""
    import ray
    import ray.data

    cfg = run.cfg
    resources = ray.cluster_resources()
    use_gpu = cfg.embed.use_gpu and resources.get("GPU", 0) > 0
    _warn_if_actors_take_every_cpu(cfg, resources.get("CPU", 0.0))
    rows = cfg.data.decode_batch_size
    blocks = [refs.slice(i, rows) for i in range(0, len(refs), rows)]  # one decode task each
    decode = functools.partial(read_and_decode, view=run.view, storage_cfg=storage.current_config(),
                               reject_log=reject_log)
    ds = ray.data.from_arrow(blocks).map_batches(decode, batch_format="pyarrow", batch_size=None,
                                                 num_cpus=cfg.data.num_decode_cpus)
    ds = ds.map_batches(
        Embedder, batch_format="numpy", batch_size=cfg.embed.batch_size,
        compute=ray.data.ActorPoolStrategy(size=cfg.embed.concurrency), num_cpus=cfg.embed.num_cpus,
        num_gpus=cfg.embed.num_gpus if use_gpu else None, resources=cfg.embed.actor_resources or None,
        fn_constructor_kwargs={"checkpoint": run.checkpoint, "backbone_weights": cfg.embed.backbone_weights,
                               "storage_cfg": storage.current_config(), "use_gpu": use_gpu,
                               "threads": int(cfg.embed.num_cpus)})
    log.info("embedding %d item(s) on %d %s actor(s)", len(refs), cfg.embed.concurrency,
             "GPU" if use_gpu else "CPU")
    yield from ds.iter_batches(batch_size=None, batch_format="numpy")


def _warn_if_actors_take_every_cpu(cfg: Config, cpus: float) -> None:
    """Actors holding every CPU starve the decode tasks and the job hangs (NOTES.md): say so."""
    wanted = cfg.embed.concurrency * cfg.embed.num_cpus + cfg.data.num_decode_cpus
    if wanted > cpus:
        log.warning("embed.concurrency x embed.num_cpus + data.num_decode_cpus = %.2f CPUs > the "
                    "cluster's %.2f: unless the cluster grows, decode tasks cannot run beside the actors "
                    "and the job waits; lower embed.num_cpus or embed.concurrency", wanted, cpus)


def _commit_stream(run: _Run, batches) -> None:
    """Commit the stream to the index every embed.commit_rows items (and the remainder at the end)."""
    pending: list[pa.Table] = []
    count = 0
    for batch in batches:
        table = batch if isinstance(batch, pa.Table) else to_table(batch)
        if len(table):
            pending.append(table)
            count += len(table)
        if count >= run.cfg.embed.commit_rows:
            _commit(run, pa.concat_tables(pending))
            pending, count = [], 0
    if count:
        _commit(run, pa.concat_tables(pending))


def _commit(run: _Run, table: pa.Table) -> None:
    """One atomic write: shard files, then the manifest (creating a flat index on first use)."""
    if not has_manifest(run.index_uri):
        create_index(run.index_uri, run.cfg.index, embedding_matrix(table),
                     expected_items=run.cfg.embed.expected_items or len(table), model_id=run.model_id)
    added = add_items(run.index_uri, table, model_id=run.model_id, source=run.catalogue)
    run.report.embedded += added.added
    run.report.shards_added += added.shards
    run.report.total = added.total
    log.info("committed %d item(s) as %s (index total %d)", added.added, added.shards, added.total)


def _reject_log(run: _Run):
    """The RejectLog actor of this catalogue's rejects file, seeded with what earlier runs listed."""
    from puma.data.pipeline import RejectLog

    name = "puma-embed-rejects-" + hashlib.sha1(run.report.rejects_uri.encode()).hexdigest()[:16]
    initial = read_rejects(run.report.rejects_uri)
    return RejectLog.options(name=name, get_if_exists=True).remote(run.report.rejects_uri,
                                                                   storage.current_config(), initial)


def _finish(run: _Run) -> None:
    """Fill the report's totals and reject counts from storage (what a reader will find)."""
    rows = read_rejects(run.report.rejects_uri)
    run.report.rejected = len(rows)
    run.report.reject_reasons = reject_counts(rows)
    if has_manifest(run.index_uri):
        run.report.total = read_manifest(run.index_uri).total


def report_dict(report: EmbedReport) -> dict:
    """The report as plain data (JSON)."""
    return dataclasses.asdict(report)
