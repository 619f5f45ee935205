"""The embedding job's side of an index location's versions (puma.index.versions): which catalogues a new
model's version must hold, when a version goes live, and removing a catalogue from every version.

``index.uri`` is a location holding one index per model. A run writes the version of its checkpoint's
model; when that is not the live version, it first embeds every catalogue the live version holds, and
the new version goes live (``promote``, after a verify) once it holds them all (index.promote=auto;
manual: jobs/index.py promote). A location written before versions existed (manifest.json at its root)
is one index, as before.
"""

from __future__ import annotations

import logging

import pyarrow.compute as pc

from puma import storage
from puma.checkpoint import checkpoint_id, resolve_checkpoint
from puma.config import Config, for_this_process
from puma.index import read_manifest
from puma.index.build import commit_changes, compact
from puma.index.manifest import Manifest, has_manifest, now
from puma.index.table import CATALOGUE, INDEX_ID
from puma.index.versions import (
    is_legacy,
    list_versions,
    live_manifest,
    missing_catalogues,
    promote,
    read_alias,
    version_uri,
)
from puma.inference.catalogue import CatalogueError
from puma.inference.reconcile import live_items

log = logging.getLogger(__name__)


def live_catalogues_for(location: str, checkpoint: str) -> list[str]:
    """The live version's catalogues when ``checkpoint`` is another model (a new version to build)."""
    if is_legacy(location) or read_alias(location) is None:
        return []
    live = live_manifest(location)
    if live is None or live.model_id == checkpoint_id(resolve_checkpoint(checkpoint)):
        return []
    return sorted(live.catalogues)


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
    cfg = for_this_process(cfg)
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
