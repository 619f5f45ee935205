"""Batch embedding of catalogues into the sharded index: what ``jobs/embed.py`` runs.

Every run reconciles: it brings each catalogue's part of the index to the catalogue as it is now.

    catalogue references (puma.inference.catalogue)        listed on the driver, no bytes read
      x the index's live rows (puma.inference.reconcile)    new / changed / restamped / removed
      - listed rejects                                      dropped BEFORE any read or decode
      -> Ray Data: read + decode + eval view (tasks, data.num_decode_cpus each)
      -> Embedder actors (embed.concurrency, model loaded once each, GPUs when present)
      -> driver: iter_batches, a commit every embed.commit_rows items (puma.index.commit_changes:
         shard files first, manifest last; a changed item's old row is removed in the same commit)
      -> final commit: restamped rows, removals of items gone from the catalogue, the run's record
      -> compaction of shards whose removed rows reach index.compact_fraction (its own commit)

Only new and changed images are read and decoded, each distinct image (image_uri, image_row) once per
run: rows sharing a photo (product variants) get its embedding and fingerprint with their own item id,
description and stamp, in the same commit, or are rejected with it (report.images counts the images).
A crash loses at most the uncommitted block; the next run plans again from what is committed and
converges. One writer per index at a time.

Versions (puma.index.versions): ``index.uri`` is a location holding one index per model. A run
writes the version of its checkpoint's model; when that is not the live version, it first embeds
every catalogue the live version holds, and the new version goes live (``promote``, after a
verify) once it holds them all (index.promote=auto; manual: jobs/index.py promote). A location
written before versions existed (manifest.json at its root) is one index, as before.

Training: a new index is planned (puma.index.plan) for embed.expected_items or the first
catalogue's size. An exact (flat) index needs no training and is created with the first block.
An IVF index is trained once, before anything is added, on the embeddings of a seeded uniform
sample of plan.train_sample of the catalogue's items; those items are then committed first, so
nothing is embedded twice. Every later catalogue joins the same trained index.

Model id: ``puma.checkpoint.checkpoint_id``, the sha256 of the checkpoint's trainable weights, its
model config and its probe embeddings: the same model copied elsewhere keeps its id.

Rejects: ``<index.uri>/rejects/<catalogue name>.jsonl`` (puma.data.rejects format; reasons
corrupt, truncated, tiny, too_large, missing_file, empty_file, and a table's empty_item_id,
missing_image_uri, duplicate_item_id). A prepared catalogue's prepare-time rejects (of the
embedded splits) are listed there too. Listed new items are not re-tried by later runs unless
embed.retry_rejects is set; a changed item is always read again.
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
import pyarrow.compute as pc

from puma import console, storage
from puma.checkpoint import best_checkpoint_uri, checkpoint_id, read_checkpoint
from puma.checkpoint import resolve_checkpoint as follow_pointer
from puma.config import Config, absolute_paths
from puma.data import schema
from puma.data.columns import take_rows
from puma.data.images import ViewSpec, eval_view_spec
from puma.data.manifest import load_manifest
from puma.data.rejects import Reject, read_rejects, reject_counts, write_rejects
from puma.data.tables import is_table
from puma.errors import UserError
from puma.faults import fault_point
from puma.index import create_index, plan_index, read_manifest
from puma.index.build import check_compatible, commit_changes, compact
from puma.index.manifest import Manifest, has_manifest, now
from puma.index.table import CATALOGUE, DATASET, INDEX_ID, ITEM_ID, ROLE, STAMP, embedding_matrix
from puma.index.versions import (
    is_legacy,
    list_versions,
    live_manifest,
    missing_catalogues,
    promote,
    read_alias,
    version_name,
    version_uri,
)
from puma.inference.catalogue import (
    SPLITS,
    CatalogueError,
    catalogue_name,
    check_unique,
    is_prepared,
    list_catalogue,
    list_catalogues,
    plain,
    without,
)
from puma.inference.embedder import (
    EMBEDDING,
    FINGERPRINT,
    META_COLUMNS,
    OUTPUT_COLUMNS,
    Embedder,
    decode_refs,
    read_and_decode,
    share_images,
    to_table,
)
from puma.inference.reconcile import LiveItems, Plan, live_items, plan, restamped_rows
from puma.job_metrics import push_embed

log = logging.getLogger(__name__)
REJECTS_DIR = "rejects"


@dataclass
class EmbedReport:
    """What one catalogue's run did."""

    catalogue: str
    index_uri: str  # the index written (a version folder of the location, or the location itself)
    location: str = ""  # index.uri
    version: str = ""  # the version written ('' for a location without versions)
    checkpoint: str = ""
    model_id: str = ""
    items: int = 0  # items the catalogue lists (the selected split), rejected rows not counted
    embedded: int = 0  # images read, decoded and embedded and written by this run (added + changed)
    images: int = 0  # distinct images decoded and embedded (rows sharing an image_uri and image_row: once)
    added: int = 0  # new items written
    changed: int = 0  # items whose image changed: embedded again, the old row removed
    restamped: int = 0  # same image, new stamp or metadata: stored embedding written again
    removed: int = 0  # items gone from the catalogue (or changed to an image that is now rejected)
    read_to_compare: int = 0  # images read (not decoded) because their listing stamp changed
    skipped_indexed: int = 0  # indexed and unchanged (or restamped): not decoded, not re-embedded
    skipped_rejected: int = 0  # listed in the rejects file by an earlier run: not re-tried
    rejected: int = 0  # items listed in the catalogue's rejects file after this run
    reject_reasons: dict = field(default_factory=dict)
    rejects_uri: str = ""
    ignored_files: int = 0  # non-image files under an image-folder catalogue
    shards_added: list[str] = field(default_factory=list)
    compacted: list[str] = field(default_factory=list)  # shards rewritten without their removed rows
    total: int = 0  # items in the index after this run
    promoted: str = ""  # the version this run made live ('' when none)
    seconds: float = 0.0
    plan_seconds: float = 0.0  # listing, stamping and comparing with the index (no image decoded)
    error: str = ""  # watch: why this catalogue failed ('' when it did not)

    def summary(self) -> str:
        """One line for the job's output."""
        if self.error:
            return f"{self.catalogue}: FAILED: {self.error}"
        version = f" [version {self.version}]" if self.version else ""
        return (f"{self.catalogue}: embedded {self.embedded}, already indexed {self.skipped_indexed}; "
                f"added {self.added}, changed {self.changed}, removed {self.removed}, "
                f"restamped {self.restamped}; rejected {self.rejected}{self._reasons()}, "
                f"{len(self.shards_added)} shard(s) added, {len(self.compacted)} compacted, "
                f"index total {self.total}{version} ({self.seconds:.1f} s, "
                f"planned in {self.plan_seconds:.1f} s)")

    def _reasons(self) -> str:
        return f" {self.reject_reasons}" if self.reject_reasons else ""

    def record(self) -> dict:
        """What the manifest keeps of this run."""
        return {"at": now(), "action": "reconcile", "catalogue": self.catalogue, "added": self.added,
                "changed": self.changed, "removed": self.removed, "restamped": self.restamped,
                "rejected": self.rejected, "shards_added": self.shards_added}


def resolve_checkpoint(cfg: Config, checkpoint: str | None = None) -> str:
    """``checkpoint``, else embed.checkpoint, else <train.storage_path>/<train.run_name>/best."""
    uri = checkpoint or cfg.embed.checkpoint or best_checkpoint_uri(cfg)
    return storage.absolute(uri)


def rejects_uri(index_uri: str, catalogue: str) -> str:
    """Where a catalogue's rejects are listed."""
    return storage.join(index_uri, REJECTS_DIR, f"{catalogue_name(catalogue)}.jsonl")


def embed_catalogue(cfg: Config, catalogue: str, *, index_uri: str | None = None,
                    checkpoint: str | None = None, split: str | None = None,
                    settle: bool = True) -> EmbedReport:
    """Reconcile one catalogue into the index: embed its new and changed items, remove what it lost.

    ``index_uri``, ``checkpoint`` and ``split`` default to index.uri, embed.checkpoint (see
    :func:`resolve_checkpoint`) and embed.split. ``settle``: make the written version live when it
    may go live (see the module doc); embed_catalogues settles once, after every catalogue.
    """
    start = time.monotonic()
    cfg = absolute_paths(cfg)
    storage.configure(cfg.storage)
    run = _prepare_run(cfg, storage.absolute(catalogue), storage.absolute(index_uri or cfg.index.uri),
                       resolve_checkpoint(cfg, checkpoint))
    _reconcile(run, split or cfg.embed.split)
    _finish(run)
    if settle:
        run.report.promoted = settle_version(cfg, run.report.location, run.report.version)
    run.report.seconds = time.monotonic() - start
    return run.report


def embed_catalogues(cfg: Config, catalogues: list[str], *, checkpoint: str | None = None,
                     keep_going: bool = False) -> list[EmbedReport]:
    """Reconcile each catalogue; with a model that is not the live one, every live catalogue too,
    then make the new version live when it holds them all. ``keep_going``: a catalogue that fails
    (bad layout, incompatible index) is reported with its error and the others still run."""
    cfg = absolute_paths(cfg)
    storage.configure(cfg.storage)
    location = storage.absolute(cfg.index.uri)
    ckpt = resolve_checkpoint(cfg, checkpoint)
    todo = [storage.absolute(c) for c in catalogues]
    todo += [c for c in _live_catalogues_for(location, ckpt) if c not in todo]
    reports = []
    for catalogue in todo:
        try:
            reports.append(embed_catalogue(cfg, catalogue, checkpoint=ckpt, settle=False))
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


def watch(cfg: Config, prefix: str) -> list[EmbedReport]:
    """Reconcile every catalogue under ``prefix``: its immediate sub-folders and its table files.

    A catalogue that fails (bad layout, incompatible index) is reported with its error and the
    others still run.
    """
    cfg = absolute_paths(cfg)
    storage.configure(cfg.storage)
    return embed_catalogues(cfg, list_catalogues(prefix), keep_going=True)


def settle_version(cfg: Config, location: str, version: str) -> str:
    """Make ``version`` live if it may go live now; returns it when it did ('' otherwise)."""
    if not version:
        return ""
    alias = read_alias(location)
    if alias is not None and alias.live == version:
        return ""
    uri = version_uri(location, version)
    if not has_manifest(uri):
        return ""
    if alias is not None and version in alias.held:
        log.warning("version %s of %s was rolled back from: it stays held until "
                    "`python jobs/index.py promote --version %s`", version, location, version)
        return ""
    if alias is not None and cfg.index.promote != "auto":
        log.warning("version %s of %s is built; make it live with "
                    "`python jobs/index.py promote --version %s`",
                    version, location, version)
        return ""
    missing = missing_catalogues(location, version)
    if missing:
        log.warning("version %s is not live yet: it lacks %d catalogue(s) of the live version, e.g. %s",
                    version, len(missing), missing[:3])
        return ""
    promote(location, version, keep=cfg.index.keep_versions)
    return version


def remove_catalogue(cfg: Config, catalogue: str) -> list[dict]:
    """Remove every item of ``catalogue`` from every version at index.uri (one commit per version,
    then compaction); returns one record per version that held it."""
    cfg = absolute_paths(cfg)
    storage.configure(cfg.storage)
    location = storage.absolute(cfg.index.uri)
    catalogue = storage.absolute(catalogue)
    uris = [location] if is_legacy(location) else [v.uri for v in list_versions(location)]
    records = []
    for uri in uris:
        manifest = read_manifest(uri)
        keys = live_items(uri, manifest).keys
        ids = keys.filter(pc.equal(keys[CATALOGUE], catalogue).fill_null(False))[INDEX_ID].to_numpy()
        if not len(ids) and catalogue not in manifest.catalogues:
            continue
        record = {"at": now(), "action": "remove_catalogue", "catalogue": catalogue, "removed": int(len(ids))}

        def update(m: Manifest, record: dict = record) -> None:
            m.catalogues.pop(catalogue, None)
            m.record_run(record)

        done = commit_changes(uri, remove=ids, source=catalogue, update=update)
        compacted = compact(uri, cfg.index.compact_fraction)
        records.append(record | {"index": uri, "total": done.total, "compacted": compacted.dropped})
    if not records:
        live = live_manifest(location)
        raise CatalogueError(f"no version at {location} holds catalogue {catalogue}; the live version's "
                             f"catalogues are {sorted(live.catalogues) if live else []}")
    return records


def _live_catalogues_for(location: str, checkpoint: str) -> list[str]:
    """The live version's catalogues when ``checkpoint`` is another model (a new version to build)."""
    if is_legacy(location) or read_alias(location) is None:
        return []
    live = live_manifest(location)
    if live is None or live.model_id == checkpoint_id(follow_pointer(checkpoint)):
        return []
    return sorted(live.catalogues)


# ----------------------------------------------------------------------------- the run


@dataclass
class _Run:
    """What one catalogue's run needs, resolved on the driver."""

    cfg: Config
    catalogue: str
    index_uri: str
    checkpoint: str
    model_id: str
    model_cfg: Config  # the checkpoint's own config
    dim: int
    report: EmbedReport
    plan: Plan | None = None
    embedder: Embedder | None = None  # the model loaded on the driver (_check_model)

    @functools.cached_property
    def view(self) -> ViewSpec:
        """The model's eval view with the job's size limit and decoder: planned on first use (it imports
        timm for the backbone's normalisation), so a run with nothing to embed never plans it."""
        view = eval_view_spec(self.model_cfg, min_size=self.cfg.data.min_image_size)
        return dataclasses.replace(view, on_worker=self.cfg.data.decode_on == "worker")


def _prepare_run(cfg: Config, catalogue: str, location: str, checkpoint: str) -> _Run:
    """The model id from the checkpoint (its own config), the index to write, a report."""
    checkpoint = follow_pointer(checkpoint)  # best/ -> its version now: the id and all actors read one model
    state = read_checkpoint(checkpoint, weights=False)  # config and id: no torch for a no-op
    model_cfg = state.config
    model_id = checkpoint_id(checkpoint, state)
    version = "" if is_legacy(location) else version_name(model_id)
    index_uri = version_uri(location, version) if version else location
    report = EmbedReport(catalogue=catalogue, index_uri=index_uri, location=location, version=version,
                         checkpoint=checkpoint, model_id=model_id,
                         rejects_uri=rejects_uri(location, catalogue))
    dim = model_cfg.model.head.embed_dim
    return _Run(cfg, catalogue, index_uri, checkpoint, model_id, model_cfg, dim, report)


def _check_model(run: _Run) -> None:
    """Load the checkpoint once on the driver with the backbone the actors will use: a model that does
    not reproduce its probe embeddings (another backbone, an edited file) is refused here in one line
    (a CheckpointError), not inside every actor's constructor, where Ray keeps only its text. The
    loaded model is kept: a small change is embedded with it here (see _embed_here)."""
    cfg = run.cfg
    run.embedder = Embedder(run.checkpoint, cfg.embed.backbone_weights, storage.current_config(),
                            use_gpu=cfg.embed.use_gpu, threads=0, runtime=cfg.embed.runtime)


def _reconcile(run: _Run, split: str) -> None:
    """Plan against the committed index, embed what is new or changed, then the final commit."""
    start = time.monotonic()
    todo = _todo(run, split)
    run.report.plan_seconds = time.monotonic() - start
    if len(todo):
        _check_model(run)
        _embed_todo(run, todo)
    if has_manifest(run.index_uri):
        _final_commit(run)


def _todo(run: _Run, split: str) -> pa.Table:
    """What to read and embed: the plan's new and changed items, less what earlier runs rejected."""
    listing = list_catalogue(run.catalogue, split, run.cfg.embed.stamp_column)
    refs = listing.refs
    if not is_table(run.catalogue):  # a table's repeated ids are rejects already
        check_unique(refs, run.catalogue)
    _list_prepare_rejects(run, split)
    run.report.items, run.report.ignored_files = len(refs), listing.ignored
    manifest = read_manifest(run.index_uri) if has_manifest(run.index_uri) else None
    if manifest is not None:
        check_compatible(manifest, manifest.dim, run.model_id, run.index_uri)  # refuse another model early
    live = live_items(run.index_uri, manifest)
    run.plan = plan(refs, run.catalogue, _in_split(live, run.catalogue, split))
    _add_rejects(run, listing.rejects + run.plan.rejects)
    run.report.read_to_compare = run.plan.hashed
    run.report.skipped_indexed = run.plan.unchanged + run.plan.restamp_count
    todo = run.plan.embed
    if not run.cfg.embed.retry_rejects:
        fixed = _forget_fixed_rejects(run, todo)
        rows = read_rejects(run.report.rejects_uri)
        bad_images = [r["item_id"] for r in rows
                      if r.get("stage") != "catalogue" and r["item_id"] not in fixed]
        listed = pa.array(bad_images, pa.string())  # a catalogue-stage reject names a row, not the item
        fresh = pc.invert(pc.is_in(todo[ITEM_ID], value_set=pa.array(list(run.plan.replaced), pa.string())))
        retried = todo.filter(pc.invert(fresh))  # changed items are always read again
        kept, run.report.skipped_rejected = without(todo.filter(fresh), listed)
        todo = pa.concat_tables([kept, retried])
    log.info("catalogue %s: %d item(s), %d to embed", run.catalogue, run.report.items, len(todo))
    return todo


def _forget_fixed_rejects(run: _Run, todo: pa.Table) -> set[str]:
    """Items rejected earlier whose image has changed since (another stamp): their old rows leave the
    rejects file and they are read again (a fixed photo is indexed without embed.retry_rejects)."""
    rows = read_rejects(run.report.rejects_uri)
    stamped = [r for r in rows if r.get("stamp")]
    at = pc.index_in(pa.array([r["item_id"] for r in stamped], pa.string()), value_set=todo[ITEM_ID])
    at = at.fill_null(-1).to_numpy(zero_copy_only=False)  # each one's row in todo, or -1
    listed = np.flatnonzero(at >= 0)
    now = dict(zip(listed.tolist(), take_rows(todo[STAMP], at[listed]).to_pylist(), strict=True))
    fixed = {r["item_id"] for i, r in enumerate(stamped) if i in now and now[i] != r["stamp"]}
    if fixed:
        write_rejects(run.report.rejects_uri, [r for r in rows if r["item_id"] not in fixed])
        log.info("catalogue %s: %d rejected image(s) changed since: read again", run.catalogue, len(fixed))
    return fixed


def _in_split(live: LiveItems, catalogue: str, split: str) -> LiveItems:
    """The live rows a run over ``split`` of a prepared catalogue answers for: another split's items
    are not removed because this run did not list them."""
    if split == "all" or not is_prepared(catalogue):
        return live
    roles = {"train": [schema.ROLE_TRAIN], "test": [schema.QUERY, schema.GALLERY]}[split]
    keys = live.keys
    mine = pc.equal(keys[CATALOGUE], catalogue).fill_null(False)
    other_split = pc.and_(mine, pc.invert(pc.is_in(keys[ROLE], value_set=pa.array(roles, pa.string()))))
    return live.where(pc.invert(other_split.fill_null(False)))


def _add_rejects(run: _Run, rows: list[dict]) -> None:
    """List the listing's and the plan's rejects in the catalogue's rejects file (first row kept)."""
    if rows:
        write_rejects(run.report.rejects_uri, [*read_rejects(run.report.rejects_uri), *rows])


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
    """Train the index if it is new, then stream the rest in commits of embed.commit_rows. Each distinct
    image is read, decoded and embedded once: rows sharing it get its embedding (_SharedImages). Up to
    embed.local_max_items images for an existing index are embedded in this process (no pipeline
    to start: a nightly run with a few changes takes seconds, not the actors' start-up)."""
    shared = _SharedImages.of(todo)
    images, title = shared.images, f"embedding {catalogue_name(run.catalogue)}"
    if len(images) <= run.cfg.embed.local_max_items and has_manifest(run.index_uri):
        with console.progress(title, len(images), "img") as bar:
            _commit_stream(run, shared.rows(run, _counted(_embed_here(run, images), bar)))
        _add_rejects(run, shared.rejects(read_rejects(run.report.rejects_uri)))
        return
    import ray

    from puma.runtime import init_ray

    init_ray()
    reject_log = _reject_log(run)
    try:
        with console.progress(title, len(images), "img") as bar:
            if not has_manifest(run.index_uri):
                images = _create_index(run, shared, len(todo), reject_log, bar)
            if len(images):
                _commit_stream(run, shared.rows(run, _counted(_stream(run, images, reject_log), bar)))
        rows = shared.rejects(ray.get(reject_log.rows.remote()))
        if rows:
            ray.get(reject_log.record.remote(rows))
    finally:
        ray.kill(reject_log)  # every decode task has recorded its rejects (ray.get) before returning


@dataclass
class _SharedImages:
    """The rows to embed as distinct images: one reference per image (image_uri, image_row) is read,
    decoded and embedded; the rows sharing it (product variants with one photo) get its embedding and
    fingerprint with their own item id, description and stamp, in the same commit."""

    images: pa.Table  # one reference per distinct image (its first row)
    sharers: pa.Table  # every other row, plain columns
    image_of: np.ndarray  # (len(sharers),) the position in ``images`` of each sharer's image
    sharers_of: dict[str, np.ndarray]  # item id of a shared image's reference -> its sharers' rows
    embedded: set = field(default_factory=set)  # references of shared images that were embedded

    @classmethod
    def of(cls, todo: pa.Table) -> _SharedImages:
        images, position = share_images(todo)
        first = np.zeros(len(todo), bool)
        first[np.unique(position, return_index=True)[1]] = True
        if first.all():
            return cls(images, todo.slice(0, 0), np.zeros(0, np.int64), {})
        rows = np.flatnonzero(~first)
        sharers, image_of = plain(take_rows(todo, rows)), position[rows]
        order = np.argsort(image_of, kind="stable")
        bounds = np.flatnonzero(np.diff(image_of[order], prepend=-1, append=-2))
        owners = images[ITEM_ID].take(pa.array(image_of[order[bounds[:-1]]])).to_pylist()
        groups = {item: order[a:b] for item, a, b in zip(owners, bounds[:-1], bounds[1:], strict=True)}
        return cls(images, sharers, image_of, groups)

    def rows(self, run: _Run, batches: Iterator) -> Iterator[pa.Table]:
        """Each embedded batch as a table, followed by the rows sharing its images; counts the images."""
        for batch in batches:
            table = batch if isinstance(batch, pa.Table) else to_table(batch)
            run.report.images += len(table)
            if self.sharers_of:
                table = pa.concat_tables([table, self._sharing(table)])
            yield table

    def _sharing(self, table: pa.Table) -> pa.Table:
        """The sharers of the batch's images, with their image's embedding and fingerprint."""
        ids = table[ITEM_ID].to_pylist()
        found = [(i, self.sharers_of[item]) for i, item in enumerate(ids) if item in self.sharers_of]
        self.embedded.update(ids[i] for i, _ in found)
        if not found:
            return table.slice(0, 0)
        rows = np.concatenate([r for _, r in found])
        source = np.concatenate([np.full(len(r), i, np.int64) for i, r in found])  # each one's image row
        own = self.sharers.take(pa.array(rows))
        columns = {c: own[c] for c in META_COLUMNS if c != FINGERPRINT}
        columns.update({c: table[c].take(pa.array(source)) for c in (EMBEDDING, FINGERPRINT)})
        return pa.table({c: columns[c].cast(table.schema.field(c).type) for c in OUTPUT_COLUMNS})

    def rejects(self, rejected: list[dict]) -> list[dict]:
        """A reject for every row sharing an image whose reference was rejected (its reason, its stage)."""
        by_item = {r["item_id"]: r for r in rejected}
        out = []
        for item, rows in self.sharers_of.items():
            if item in self.embedded or item not in by_item:
                continue
            first = by_item[item]
            for r in self.sharers.take(pa.array(rows)).to_pylist():
                detail = f"{first.get('detail', '')} (the image of item {item!r}, read once for every row)"
                out.append(Reject(item_id=r[ITEM_ID], dataset=r[DATASET], reason=first["reason"],
                                  stage=first["stage"], source_path=r[schema.SOURCE_PATH],
                                  split=r[schema.SPLIT], detail=detail, stamp=r[STAMP]).to_dict())
        return out


def _embed_here(run: _Run, todo: pa.Table) -> Iterator[dict[str, np.ndarray]]:
    """Read, decode and embed ``todo`` in this process with the model _check_model loaded, in
    batches of embed.batch_size; rejects go to the catalogue's rejects file as the pipeline's do."""
    size = run.cfg.embed.batch_size
    for start in range(0, len(todo), size):
        batch, rejects = decode_refs(todo.slice(start, size), run.view)
        _add_rejects(run, rejects)
        yield run.embedder(batch)


def _counted(batches: Iterator, bar: console.Progress) -> Iterator:
    """The batches, each counted on the progress display as it passes."""
    for batch in batches:
        bar.update(len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch))
        yield batch


def _create_index(run: _Run, shared: _SharedImages, count: int, reject_log,
                  bar: console.Progress) -> pa.Table:
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
    tables = [to_table(b) for b in _counted(_stream(run, sample, reject_log), bar)]
    table = pa.concat_tables(tables) if tables else None
    if table is None or len(table) == 0:
        raise CatalogueError(f"no image of the training sample of {run.catalogue} could be decoded; "
                             f"see {run.report.rejects_uri}")
    _new_index(run, embedding_matrix(table), expected)
    _commit_stream(run, shared.rows(run, iter([table])))
    return without(todo, sample[ITEM_ID].combine_chunks())[0]


def _stream(run: _Run, refs: pa.Table, reject_log) -> Iterator[dict[str, np.ndarray]]:
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
                               reject_log=reject_log)
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
    """One atomic write: shard files, removal of the changed items' old rows, then the manifest
    (creating a flat index on first use)."""
    if not has_manifest(run.index_uri):
        _new_index(run, embedding_matrix(table), run.cfg.embed.expected_items or len(table))
    replaced = run.plan.replaced if run.plan is not None else {}
    old = [replaced.pop(i) for i in table[ITEM_ID].to_pylist() if i in replaced]
    done = commit_changes(run.index_uri, table, remove=np.array(old, dtype=np.int64), source=run.catalogue)
    run.report.embedded += done.added
    run.report.changed += len(old)
    run.report.added += done.added - len(old)
    run.report.shards_added += done.shards
    run.report.total = done.total
    log.info("committed %d item(s) as %s (%d replacing changed ones; index total %d)", done.added,
             done.shards, len(old), done.total)
    fault_point("embed.block")


def _new_index(run: _Run, train_vectors: np.ndarray, expected: int) -> None:
    """Create the index this run writes; the first version of a location is live from its creation
    (there is no other to keep serving), so readers see it grow as it commits."""
    create_index(run.index_uri, run.cfg.index, train_vectors, expected_items=expected, model_id=run.model_id,
                 checkpoint=run.checkpoint)
    if run.report.version and read_alias(run.report.location) is None:
        promote(run.report.location, run.report.version)
        run.report.promoted = run.report.version


def _final_commit(run: _Run) -> None:
    """Restamped rows, removals (items gone, changed items whose new image was rejected) and the run's
    record in one commit; then compaction when removed rows pass index.compact_fraction of a shard."""
    p = run.plan
    manifest = read_manifest(run.index_uri)
    restamped = restamped_rows(run.index_uri, manifest, p) if p is not None else None
    leftover = list(p.replaced.values()) if p is not None else []  # restamped, or changed but now rejected
    gone = p.removed if p is not None else np.zeros(0, np.int64)
    remove = np.concatenate([gone, np.array(leftover, dtype=np.int64)])
    run.report.restamped = 0 if restamped is None else len(restamped)
    run.report.removed = len(gone) + len(leftover) - run.report.restamped
    record = run.report.record()
    items = (p.indexed if p is not None else 0) + run.report.added - run.report.removed

    def update(m: Manifest) -> None:
        m.catalogues[run.catalogue] = {"name": catalogue_name(run.catalogue), "items": items,
                                       "updated": now()}
        m.checkpoint = m.checkpoint or run.checkpoint
        m.record_run(record)

    done = commit_changes(run.index_uri, restamped, remove=remove, source=run.catalogue, update=update)
    run.report.shards_added += done.shards
    compacted = compact(run.index_uri, run.cfg.index.compact_fraction)
    run.report.compacted = compacted.dropped
    run.report.total = compacted.total or done.total


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
