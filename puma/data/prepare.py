"""Raw release layouts -> Parquet shards + manifest on any URI; idempotent, content-addressed.

Layout of a prepared root::

    manifest.json                             written last (see puma.data.manifest)
    train/part-00000-<sha12>.parquet ...      rows of split train, shuffled by a hash of item_id
    test/part-00000-<sha12>.parquet ...       rows of split test
    rejects/prepare.jsonl                     images listed by a release but missing, empty, or
                                              not decodable (corrupt, truncated, too large), and
                                              the rows of a catalogue table that are not items

With ``max_side`` (``data.prepare_max_side``) images whose longer side exceeds it are stored shrunk
to it (``images.shrink_encoded``), so decoding reads a small image instead of a full-size photo; the
manifest's ``spec`` records the value and ``resize`` how many images it shrank and the bytes saved.

Rows are ordered by a hash of their item id, so every shard mixes datasets (good for local
shuffles) and the order never depends on listing order. A shard holds at most ``data.shard_rows``
rows and about 256 MiB of images (row groups of 256 rows; images stored uncompressed, as encoded).
Shard names carry their checksum: a re-run that produces the same bytes writes nothing, an
interrupted run leaves the previous manifest and its shards intact, and stale shards are deleted
only after the new manifest is in.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

import puma
from puma import console, storage
from puma.data import schema
from puma.data.images import ImageRejected, shrink_encoded, verify_image
from puma.data.listing import DatasetListing, LayoutError, SourceItem
from puma.data.manifest import DataNotPreparedError, Manifest, load_manifest, manifest_uri, verify_shards
from puma.data.rejects import Reject, write_rejects
from puma.data.sources import CONVERTERS, SourceSpec, convert, demo_specs, preset_specs
from puma.data.stats import count_rows, count_table, paper_check

ROW_GROUP_ROWS = 256
SHARD_MAX_BYTES = 256 << 20  # a shard closes at data.shard_rows rows or this many image bytes


@dataclass
class PrepareReport:
    """What a prepare run did."""

    manifest: Manifest
    written: list[str] = field(default_factory=list)  # shard paths written this run
    unchanged: list[str] = field(default_factory=list)  # shard paths already there with the same bytes
    deleted: list[str] = field(default_factory=list)  # stale shard URIs removed
    manifest_changed: bool = True


@dataclass
class ResizeCount:
    """What ``max_side`` did: images shrunk and their bytes before and after."""

    images: int = 0
    bytes_before: int = 0
    bytes_after: int = 0

    def add(self, before: int, after: int) -> None:
        self.images += 1
        self.bytes_before += before
        self.bytes_after += after


def spec_dict(preset: str, specs: Sequence[SourceSpec], shard_rows: int, max_side: int = 0) -> dict:
    """What produced a prepared root (stored in the manifest; ensure_prepared compares it)."""
    spec = {"preset": preset, "sources": [s.to_dict() for s in specs], "shard_rows": shard_rows}
    return {**spec, "prepare_max_side": max_side} if max_side else spec  # roots made before it still match


def prepare(specs: Sequence[SourceSpec], out_uri: str, shard_rows: int = 2000, preset: str = "",
            read_threads: int = 16, log: Callable[[str], None] = print,
            verify_images: bool = True, max_side: int = 0) -> PrepareReport:
    """Convert every source, write shards, rejects and manifest under ``out_uri``.

    ``verify_images``: decode every image (``verify_image``) and reject what fails; False only for
    measuring what the check costs (bench/bench_storage.py). ``max_side`` > 0: store images whose
    longer side exceeds it shrunk to it (0: as encoded).
    """
    out_uri = storage.absolute(out_uri)
    listings = _convert_all(specs, log)
    old = _old_shards(out_uri)
    report = PrepareReport(manifest=Manifest(out_uri, {}))
    shards, kept, resized = [], [], ResizeCount()
    rejects = [r for lst in listings for r in lst.rejects]  # found by the converters (catalogue tables)
    total = sum(len(lst.items) for lst in listings)
    with console.progress("preparing", total, "img", tag="[puma.data]") as bar:
        for split in schema.STORED_SPLITS:
            items = sorted((i for lst in listings for i in lst.items if i.split == split), key=_order_key)
            for start in range(0, len(items), shard_rows):
                rows, missing = _read_chunk(items[start:start + shard_rows], read_threads, verify_images, bar,
                                            max_side, resized)
                rejects += missing
                kept += [(item.dataset, item.label, item.split, item.role) for item, _ in rows]
                for part in _split_by_bytes(rows, SHARD_MAX_BYTES):
                    index = sum(1 for s in shards if s["split"] == split)
                    shards.append(_write_shard(out_uri, split, index, part, old, report))
            log(f"[puma.data] {split}: {sum(s['rows'] for s in shards if s['split'] == split):,} rows")
    data = _manifest_data(spec_dict(preset, specs, shard_rows, max_side), listings, shards, kept, rejects)
    if max_side:
        data["resize"] = {"max_side": max_side, **dataclasses.asdict(resized)}
        log(f"[puma.data] shrank {resized.images:,} image(s) to a longer side of {max_side} px: "
            f"{resized.bytes_before / 2**20:,.1f} -> {resized.bytes_after / 2**20:,.1f} MiB")
    write_rejects(storage.join(out_uri, schema.PREPARE_REJECTS_NAME), rejects)
    report.manifest, report.manifest_changed = _commit_manifest(out_uri, data)
    report.deleted = _delete_stale(out_uri, shards)
    return report


def _convert_all(specs: Sequence[SourceSpec], log: Callable[[str], None]) -> list[DatasetListing]:
    names = [s.name for s in specs]
    if not specs or len(set(names)) != len(names):
        raise LayoutError(f"need at least one source and unique dataset names, got {names}")
    listings = []
    for spec in specs:
        listing = convert(spec)
        rejected = f", {len(listing.rejects):,} rows rejected" if listing.rejects else ""
        log(f"[puma.data] {spec.name}: {len(listing.items):,} images, {listing.num_classes:,} classes"
            f"{rejected} ({spec.kind} layout at {storage.redact(spec.uri)})")
        listings.append(listing)
    return listings


def _order_key(item: SourceItem) -> bytes:
    return hashlib.blake2b(item.item_id.encode(), digest_size=8).digest()


def _read_chunk(items: Sequence[SourceItem], threads: int, verify: bool = True,
                bar: console.Progress | None = None, max_side: int = 0, resized: ResizeCount | None = None
                ) -> tuple[list[tuple[SourceItem, bytes]], list[Reject]]:
    """The bytes of each item (threads for S3; shrunk to ``max_side`` if > 0, counted in ``resized``);
    missing, empty or undecodable files become rejects."""
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        results = []
        for result in pool.map(functools.partial(_read_item, verify=verify, max_side=max_side), items):
            results.append(result)
            if bar is not None:
                bar.update()
    rows, rejects = [], []
    for item, (data, reason, detail, original_bytes) in zip(items, results, strict=True):
        if reason:
            rejects.append(Reject(item.item_id, item.dataset, reason, "prepare", item.source_path,
                                  item.split, detail))
            continue
        rows.append((item, data))
        if original_bytes and resized is not None:
            resized.add(original_bytes, len(data))
    return rows, rejects


def _split_by_bytes(rows: list, max_bytes: int) -> list[list]:
    """Consecutive groups of rows whose image bytes stay under ``max_bytes`` (one row at least)."""
    groups, size = [], max_bytes
    for row in rows:
        if size + len(row[1]) > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(row)
        size += len(row[1])
    return groups


def _read_item(item: SourceItem, verify: bool = True, max_side: int = 0) -> tuple[bytes, str, str, int]:
    """(bytes, '', '', original size if shrunk else 0) for an image that decodes, else
    (b'', reason, detail, 0)."""
    if item.data is not None:
        data = item.data
    else:
        try:
            data = storage.read_bytes(item.source_path)
        except FileNotFoundError:
            return b"", "missing_file", "", 0
    if not data:
        return b"", "empty_file", "0 bytes", 0
    try:
        small = shrink_encoded(data, max_side) if max_side else None  # decodes (so verifies) what it shrinks
        if verify and small is None:
            verify_image(data)
    except ImageRejected as exc:
        return b"", exc.reason, exc.detail, 0
    return (small, "", "", len(data)) if small is not None else (data, "", "", 0)


def encode_shard(rows: Sequence[tuple[SourceItem, bytes]]) -> bytes:
    """Parquet bytes of rows in the contract's schema (images stored uncompressed, as encoded)."""
    items = [item for item, _ in rows]
    table = pa.table({
        schema.ITEM_ID: [i.item_id for i in items], schema.DATASET: [i.dataset for i in items],
        schema.LABEL: [i.label for i in items], schema.CLASS_NAME: [i.class_name for i in items],
        schema.SPLIT: [i.split for i in items], schema.ROLE: [i.role for i in items],
        schema.IMAGE: [data for _, data in rows], schema.SOURCE_PATH: [i.source_path for i in items],
    }, schema=schema.ARROW_SCHEMA)
    buf = io.BytesIO()
    compression = {c: ("none" if c == schema.IMAGE else "zstd") for c in schema.COLUMNS}
    pq.write_table(table, buf, row_group_size=ROW_GROUP_ROWS, compression=compression,
                   use_dictionary=[schema.DATASET, schema.CLASS_NAME, schema.SPLIT, schema.ROLE])
    return buf.getvalue()


def _write_shard(out_uri: str, split: str, index: int, rows, old: dict[str, dict],
                 report: PrepareReport) -> dict:
    """Write one shard unless the same bytes are already there; its manifest entry."""
    data = encode_shard(rows)
    digest = storage.sha256(data)
    path = f"{split}/part-{index:05d}-{digest[:12]}.parquet"
    entry = {"path": path, "split": split, "rows": len(rows), "bytes": len(data), "sha256": digest}
    if old.get(path) == entry and storage.exists(storage.join(out_uri, path)):
        report.unchanged.append(path)
    else:
        storage.write_bytes(storage.join(out_uri, path), data)
        report.written.append(path)
    return entry


def _old_shards(out_uri: str) -> dict[str, dict]:
    """Shard entries of the manifest already at ``out_uri`` (empty if none or unreadable)."""
    try:
        return {s["path"]: s for s in load_manifest(out_uri).data["shards"]}
    except (DataNotPreparedError, schema.SchemaError, KeyError, ValueError):
        return {}


def _manifest_data(spec: dict, listings: Sequence[DatasetListing], shards: list[dict],
                   kept: list[tuple], rejects: list[Reject]) -> dict:
    counts = count_rows(kept)
    datasets = {}
    for lst in listings:
        c = counts.get(lst.name, {})
        datasets[lst.name] = {
            "kind": lst.kind, "source": storage.redact(lst.source), "num_classes": lst.num_classes,
            "num_train_classes": lst.num_train_classes, "classes": lst.class_names, "counts": c,
            "paper_check": paper_check(lst.kind, lst.num_classes, c), **lst.notes}
    totals = {split: sum(s["rows"] for s in shards if s["split"] == split) for split in schema.STORED_SPLITS}
    return {"schema_version": schema.SCHEMA_VERSION, "format": "puma-prepared-parquet",
            "columns": list(schema.COLUMNS), "spec": spec, "datasets": datasets, "shards": shards,
            "totals": {**totals, "rows": sum(totals.values())},
            "rejects": {"path": schema.PREPARE_REJECTS_NAME, "count": len(rejects),
                        "by_reason": dict(sorted(Counter(r.reason for r in rejects).items()))},
            "versions": {"puma": puma.__version__, "pyarrow": pa.__version__}}


def _commit_manifest(out_uri: str, data: dict) -> tuple[Manifest, bool]:
    """Write the manifest unless identical; returns it and whether it changed."""
    manifest = Manifest(out_uri, json.loads(json.dumps(data)))
    uri = manifest_uri(out_uri)
    text = manifest.to_json()
    if storage.exists(uri) and storage.read_text(uri) == text:
        return manifest, False
    storage.write_text(uri, text)
    return manifest, True


def _delete_stale(out_uri: str, shards: list[dict]) -> list[str]:
    """Remove shard files that the new manifest does not list."""
    keep = {storage.join(out_uri, s["path"]) for s in shards}
    found = [uri for split in schema.STORED_SPLITS
             for uri in storage.list_files(storage.join(out_uri, split), suffix=".parquet")]
    stale = [uri for uri in found if uri not in keep]
    for uri in stale:
        storage.delete(uri)
    return stale


def config_specs(data_cfg) -> list[SourceSpec] | None:
    """Sources implied by ``data.preset``: demo, or one official preset read from data.source_root."""
    if data_cfg.preset == "demo":
        return demo_specs(data_cfg)
    if data_cfg.preset in CONVERTERS and data_cfg.preset not in ("folder", "table"):  # these need --name
        return [SourceSpec(data_cfg.preset, data_cfg.preset, data_cfg.source_root)]
    return None


def ensure_prepared(cfg) -> Manifest:
    """The manifest at ``data.uri``, preparing it first when ``data.preset`` says how and it is missing.

    An existing manifest made by the same preset with a different spec (e.g. another per-class cap)
    is rebuilt; one made by another preset (e.g. the eight datasets prepared by hand) is used as is.
    """
    uri = cfg.data.uri
    specs = config_specs(cfg.data)
    if storage.exists(manifest_uri(uri)):
        manifest = load_manifest(uri)
        spec = manifest.data.get("spec", {})
        if specs is None or spec.get("preset") != cfg.data.preset or \
                spec == spec_dict(cfg.data.preset, specs, cfg.data.shard_rows, cfg.data.prepare_max_side):
            manifest.check_view_size(cfg.model.backbone.img_size)
            return manifest
    elif specs is None:
        raise DataNotPreparedError(f"no prepared data at {uri} and data.preset={cfg.data.preset!r} names no "
                                   f"source; run python jobs/prepare_data.py --preset PRESET --source ROOT "
                                   f"--out {uri}")
    return prepare(specs, uri, cfg.data.shard_rows, preset=cfg.data.preset,
                   max_side=cfg.data.prepare_max_side).manifest


def job_specs(cfg, preset: str, sources: Sequence[str], name: str = "",
              class_depth: int = 1) -> list[SourceSpec]:
    """Specs for jobs/prepare_data.py: ``demo`` (--source replaces data.source_root) or official presets."""
    if preset == "demo":
        data_cfg = dataclasses.replace(cfg.data, source_root=sources[0]) if sources else cfg.data
        return demo_specs(data_cfg)
    if not sources:
        raise LayoutError(f"--preset {preset} needs --source ROOT (the release's root folder, local or s3://)")
    return preset_specs(preset.split(","), sources, name, class_depth)


def print_report(report: PrepareReport, verify: bool = False, out=print) -> int:
    """Print where the outputs went, the per-dataset counts and checks; 1 if verification failed."""
    m = report.manifest
    out(f"[puma.data] manifest: {storage.redact(manifest_uri(m.uri))} "
        f"({'updated' if report.manifest_changed else 'unchanged'})")
    out(f"[puma.data] shards:   {len(m.data['shards'])} under {storage.redact(m.uri)} "
        f"({len(report.written)} written, {len(report.unchanged)} unchanged, "
        f"{len(report.deleted)} stale deleted)")
    rejects = m.data["rejects"]
    out(f"[puma.data] rejects:  {rejects['count']} {rejects['by_reason']} -> {storage.redact(m.rejects_uri)}")
    out(count_table(m.datasets))
    for name, info in sorted(m.datasets.items()):
        if "note" in info["paper_check"]:
            out(f"[puma.data] note ({name}): {info['paper_check']['note']}")
    if not verify:
        return 0
    problems = verify_shards(m)
    out(f"[puma.data] verify: {'all shards match their sha256' if not problems else problems}")
    return 1 if problems else 0
