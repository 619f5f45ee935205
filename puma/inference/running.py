"""Where a run's images are read, decoded and embedded: in this process, or a Ray Data pipeline.

    few images, existing index (embed.local_max_items)   the driver's model (check_model), in batches
                                                         of embed.batch_size: no pipeline to start
    else Ray Data: read + decode + eval view (tasks, data.num_decode_cpus each)
      -> Embedder actors (embed.concurrency, model loaded once each, GPUs when present)
      -> driver: iter_batches, committed as they come (puma.inference.commits)

Rejects go to the catalogue's rejects file either way (the pipeline's through a RejectLog actor).

Training: a new index is planned (puma.index.plan) for embed.expected_items or the catalogue's size.
An exact (flat) index needs no training and is created with the first block. An IVF index is trained
once, before anything is added, on the embeddings of a seeded uniform sample of plan.train_sample of
the catalogue's images; those are then committed first, so nothing is embedded twice.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from puma import console, storage
from puma.config import Config
from puma.data.columns import take_rows
from puma.data.rejects import read_rejects
from puma.index import plan_index
from puma.index.manifest import has_manifest
from puma.index.table import ITEM_ID, embedding_matrix
from puma.inference.catalogue import CatalogueError, catalogue_name, plain, without
from puma.inference.commits import commit_stream, new_index
from puma.inference.embedder import Embedder, decode_refs, read_and_decode, to_table
from puma.inference.planning import SharedImages
from puma.inference.rejects import add_rejects, reject_log
from puma.inference.run import Run

log = logging.getLogger(__name__)


def embed_todo(run: Run, todo: pa.Table) -> None:
    """Train the index if it is new, then stream the rest in commits of embed.commit_rows. Each distinct
    image is read, decoded and embedded once: rows sharing it get its embedding (SharedImages). Up to
    embed.local_max_items images for an existing index are embedded in this process (no pipeline
    to start: a nightly run with a few changes takes seconds, not the actors' start-up)."""
    shared = SharedImages.of(todo)
    images, title = shared.images, f"embedding {catalogue_name(run.catalogue)}"
    if len(images) <= run.cfg.embed.local_max_items and has_manifest(run.index_uri):
        with console.progress(title, len(images), "img") as bar:
            commit_stream(run, shared.rows(run, _counted(_embed_here(run, images), bar)))
        add_rejects(run.report.rejects_uri, shared.rejects(read_rejects(run.report.rejects_uri)))
        return
    import ray

    from puma.runtime import init_ray

    init_ray()
    log_actor = reject_log(run.report.rejects_uri)
    try:
        with console.progress(title, len(images), "img") as bar:
            if not has_manifest(run.index_uri):
                images = _create_index(run, shared, len(todo), log_actor, bar)
            if len(images):
                commit_stream(run, shared.rows(run, _counted(_stream(run, images, log_actor), bar)))
        rows = shared.rejects(ray.get(log_actor.rows.remote()))
        if rows:
            ray.get(log_actor.record.remote(rows))
    finally:
        ray.kill(log_actor)  # every decode task has recorded its rejects (ray.get) before returning


def _embed_here(run: Run, todo: pa.Table) -> Iterator[dict[str, np.ndarray]]:
    """Read, decode and embed ``todo`` in this process with the model check_model loaded, in
    batches of embed.batch_size; rejects go to the catalogue's rejects file as the pipeline's do."""
    size = run.cfg.embed.batch_size
    for start in range(0, len(todo), size):
        batch, rejects = decode_refs(todo.slice(start, size), run.view)
        add_rejects(run.report.rejects_uri, rejects)
        yield run.embedder(batch)


def _counted(batches: Iterator, bar: console.Progress) -> Iterator:
    """The batches, each counted on the progress display as it passes."""
    for batch in batches:
        bar.update(len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch))
        yield batch


def _create_index(run: Run, shared: SharedImages, count: int, log_actor, bar: console.Progress) -> pa.Table:
    """IVF: embed a seeded sample of the distinct images, train on it and commit it (with the rows sharing
    those images); flat: created by the first commit. Returns the images left to embed."""
    todo = shared.images
    expected = run.cfg.embed.expected_items or count
    plan = plan_index(run.cfg.index, expected, run.dim)
    log.info("new index %s: %s for %d items", run.index_uri, plan.factory, expected)
    if plan.index_type == "flat":
        return todo
    rows = np.sort(np.random.default_rng(run.cfg.index.seed).choice(
        len(todo), size=min(len(todo), plan.train_sample), replace=False))
    sample = take_rows(todo, rows)
    tables = [to_table(b) for b in _counted(_stream(run, sample, log_actor), bar)]
    table = pa.concat_tables(tables) if tables else None
    if table is None or len(table) == 0:
        raise CatalogueError(f"no image of the training sample of {run.catalogue} could be decoded; "
                             f"see {run.report.rejects_uri}")
    new_index(run, embedding_matrix(table), expected)
    commit_stream(run, shared.rows(run, iter([table])))
    return without(todo, sample[ITEM_ID].combine_chunks())[0]


def _stream(run: Run, refs: pa.Table, log_actor) -> Iterator[dict[str, np.ndarray]]:
    """Embedded numpy batches of ``refs`` from the Ray Data pipeline (read, decode, embed)."""
    import ray
    import ray.data

    cfg = run.cfg
    resources = ray.cluster_resources()
    use_gpu = cfg.embed.use_gpu and resources.get("GPU", 0) > 0 and cfg.embed.runtime == "torch"
    _warn_if_actors_take_every_cpu(cfg, resources.get("CPU", 0.0))
    rows = cfg.data.decode_batch_size
    blocks = [plain(refs.slice(i, rows)) for i in range(0, len(refs), rows)]  # one decode task each
    decode = functools.partial(read_and_decode, view=run.view, storage_cfg=storage.current_config(),
                               reject_log=log_actor)
    # from_blocks: the blocks' metadata computed here; from_arrow runs one Ray task per block for it
    # (2.2 s before the first decode for 184 blocks on 2 cores, bench/bench_embed.py)
    ds = ray.data.from_blocks(blocks).map_batches(decode, batch_format="pyarrow", batch_size=None,
                                                  num_cpus=cfg.data.num_decode_cpus)
    ds = ds.map_batches(
        Embedder, batch_format="numpy", batch_size=cfg.embed.batch_size,
        compute=ray.data.ActorPoolStrategy(size=cfg.embed.concurrency), num_cpus=cfg.embed.num_cpus,
        num_gpus=cfg.embed.num_gpus if use_gpu else None, resources=cfg.embed.actor_resources or None,
        fn_constructor_kwargs={"checkpoint": run.checkpoint, "backbone_weights": cfg.embed.backbone_weights,
                               "storage_cfg": storage.current_config(), "use_gpu": use_gpu,
                               "threads": max(1, int(cfg.embed.num_cpus)), "runtime": cfg.embed.runtime,
                               "onnx_model": run.embedder.onnx_model if run.embedder else None,
                               "onnx_probe": run.embedder.onnx_probe if run.embedder else None})
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
