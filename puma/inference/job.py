"""Batch embedding of catalogues into the sharded index: what ``jobs/embed.py`` runs.

Every run reconciles: it brings each catalogue's part of the index to the catalogue as it is now.

    catalogue references (puma.inference.catalogue)        listed on the driver, no bytes read
      x the index's live rows (puma.inference.reconcile)    new / changed / restamped / removed
      - listed rejects (puma.inference.rejects)             dropped BEFORE any read or decode
                                                            (puma.inference.planning: what to embed)
      -> Ray Data: read + decode + eval view (tasks, data.num_decode_cpus each)
      -> Embedder actors (embed.concurrency, model loaded once each, GPUs when present)
         (puma.inference.running; a few images for an existing index: in this process)
      -> driver: iter_batches, a commit every embed.commit_rows items (puma.index.commit_changes:
         shard files first, manifest last; a changed item's old row is removed in the same commit)
      -> final commit: restamped rows, removals of items gone from the catalogue, the run's record
      -> compaction of shards whose removed rows reach index.compact_fraction (its own commit)
         (puma.inference.commits)

Only new and changed images are read and decoded, each distinct image (image_uri, image_row) once per
run: rows sharing a photo (product variants) get its embedding and fingerprint with their own item id,
description and stamp, in the same commit, or are rejected with it (report.images counts the images).
A crash loses at most the uncommitted block; the next run plans again from what is committed and
converges. One writer per index at a time.

Versions (puma.index.versions; puma.inference.versions): ``index.uri`` is a location holding one index
per model. A run writes the version of its checkpoint's model; when that is not the live version, it
first embeds every catalogue the live version holds, and the new version goes live (``promote``, after
a verify) once it holds them all (index.promote=auto; manual: jobs/index.py promote). A location
written before versions existed (manifest.json at its root) is one index, as before.

Training: a new index is planned (puma.index.plan) for embed.expected_items or the first
catalogue's size. An exact (flat) index needs no training and is created with the first block.
An IVF index is trained once, before anything is added, on the embeddings of a seeded uniform
sample of plan.train_sample of the catalogue's items; those items are then committed first, so
nothing is embedded twice. Every later catalogue joins the same trained index.

Checkpoint: the one given, else embed.checkpoint, else <train.storage_path>/<train.run_name>/best
(``puma.checkpoint.configured_checkpoint``). Model id: ``puma.checkpoint.checkpoint_id``, the sha256 of
the checkpoint's trainable weights, its model config and its probe embeddings: the same model copied
elsewhere keeps its id.

Rejects: ``<index.uri>/rejects/<catalogue name>.jsonl`` (puma.data.rejects format; reasons
corrupt, truncated, tiny, too_large, missing_file, empty_file, and a table's empty_item_id,
missing_image_uri, duplicate_item_id). A prepared catalogue's prepare-time rejects (of the
embedded splits) are listed there too. Listed new items are not re-tried by later runs unless
embed.retry_rejects is set; a changed item is always read again.

Setup: each public entry (embed_catalogue, embed_catalogues, watch, remove_catalogue) makes the
config's paths absolute and configures storage (``puma.config.for_this_process``; free again on a
config it returned, e.g. from the job's entry point) and hands the result on to the steps below it.
"""

from __future__ import annotations

import logging
import time

from puma import storage
from puma.checkpoint import checkpoint_id, configured_checkpoint
from puma.config import Config, for_this_process
from puma.data.rejects import read_rejects, reject_counts
from puma.errors import UserError
from puma.index import read_manifest
from puma.index.layout import REJECTS_DIR
from puma.index.manifest import has_manifest
from puma.inference.catalogue import catalogue_name, list_catalogues
from puma.inference.commits import final_commit
from puma.inference.planning import what_to_embed
from puma.inference.rejects import rejects_uri
from puma.inference.run import EmbedReport, Run, check_model, prepare_run, report_dict
from puma.inference.running import embed_todo
from puma.inference.versions import live_catalogues_for, remove_catalogue, settle_version
from puma.job_metrics import push_embed

__all__ = ["REJECTS_DIR", "EmbedReport", "checkpoint_id", "embed_catalogue", "embed_catalogues",
           "rejects_uri", "remove_catalogue", "report_dict", "resolve_checkpoint", "settle_version", "watch"]
log = logging.getLogger(__name__)
resolve_checkpoint = configured_checkpoint  # its old name (puma.inference.resolve_checkpoint), kept working


def embed_catalogue(cfg: Config, catalogue: str, *, index_uri: str | None = None,
                    checkpoint: str | None = None, split: str | None = None,
                    settle: bool = True) -> EmbedReport:
    """Reconcile one catalogue into the index: embed its new and changed items, remove what it lost.

    ``index_uri``, ``checkpoint`` and ``split`` default to index.uri, embed.checkpoint (see
    :func:`puma.checkpoint.configured_checkpoint`) and embed.split. ``settle``: make the written version
    live when it may go live (see the module doc); embed_catalogues settles once, after every catalogue.
    """
    start = time.monotonic()
    cfg = for_this_process(cfg)
    ckpt = configured_checkpoint(cfg, checkpoint)
    index_uri, split = index_uri or cfg.index.uri, split or cfg.embed.split
    return _embed_catalogue(cfg, catalogue, index_uri, ckpt, split, settle, start)


def embed_catalogues(cfg: Config, catalogues: list[str], *, checkpoint: str | None = None,
                     keep_going: bool = False) -> list[EmbedReport]:
    """Reconcile each catalogue; with a model that is not the live one, every live catalogue too,
    then make the new version live when it holds them all. ``keep_going``: a catalogue that fails
    (bad layout, incompatible index) is reported with its error and the others still run."""
    return _embed_catalogues(for_this_process(cfg), catalogues, checkpoint, keep_going)


def watch(cfg: Config, prefix: str) -> list[EmbedReport]:
    """Reconcile every catalogue under ``prefix``: its immediate sub-folders and its table files.

    A catalogue that fails (bad layout, incompatible index) is reported with its error and the
    others still run.
    """
    cfg = for_this_process(cfg)
    return _embed_catalogues(cfg, list_catalogues(prefix), None, keep_going=True)


def _embed_catalogues(cfg: Config, catalogues: list[str], checkpoint: str | None,
                      keep_going: bool) -> list[EmbedReport]:
    """embed_catalogues with ``cfg`` from for_this_process."""
    location = storage.absolute(cfg.index.uri)
    ckpt = configured_checkpoint(cfg, checkpoint)
    todo = [storage.absolute(c) for c in catalogues]
    todo += [c for c in live_catalogues_for(location, ckpt) if c not in todo]
    reports = []
    for catalogue in todo:
        try:
            reports.append(_embed_catalogue(cfg, catalogue, location, ckpt, cfg.embed.split, False,
                                            time.monotonic()))
        except UserError as exc:  # CatalogueError, IndexInputError, SchemaError, CheckpointError, ...
            push_embed(cfg.metrics, catalogue_name(catalogue),
                       EmbedReport(catalogue=catalogue, index_uri=location, error=str(exc)))
            if not keep_going:
                raise
            log.error("catalogue %s failed: %s", catalogue, exc)
            reports.append(EmbedReport(catalogue=catalogue, index_uri=location, location=location,
                                       error=str(exc)))
            continue
        push_embed(cfg.metrics, catalogue_name(catalogue), reports[-1])  # metrics.pushgateway, when set
    done = [r for r in reports if not r.error]
    if done and not any(r.error for r in reports):
        done[-1].promoted = settle_version(cfg, location, done[-1].version)
    return reports


def _embed_catalogue(cfg: Config, catalogue: str, index_uri: str, checkpoint: str, split: str,
                     settle: bool, start: float) -> EmbedReport:
    """embed_catalogue with ``cfg`` from for_this_process and the checkpoint found."""
    run = prepare_run(cfg, storage.absolute(catalogue), storage.absolute(index_uri), checkpoint)
    _reconcile(run, split)
    _finish(run)
    if settle:
        run.report.promoted = settle_version(cfg, run.report.location, run.report.version)
    run.report.seconds = time.monotonic() - start
    return run.report


def _reconcile(run: Run, split: str) -> None:
    """Plan against the committed index, embed what is new or changed, then the final commit."""
    start = time.monotonic()
    todo = what_to_embed(run, split)
    run.report.plan_seconds = time.monotonic() - start
    if len(todo):
        check_model(run)
        embed_todo(run, todo)
    if has_manifest(run.index_uri):
        final_commit(run)


def _finish(run: Run) -> None:
    """Fill the report's totals and reject counts from storage (what a reader will find)."""
    rows = read_rejects(run.report.rejects_uri)
    run.report.rejected = len(rows)
    run.report.reject_reasons = reject_counts(rows)
    if has_manifest(run.index_uri):
        run.report.total = read_manifest(run.index_uri).total
