"""Index versions, one per model, and the alias that names the live one.

An index location (``index.uri``, local path or s3://; its paths are named in ``puma.index.layout``)
holds::

    alias.json                  {"live": "<version>", "previous": "<version>", "history": [...]}
    versions/<version>/         one index (puma.index.manifest layout) per model:
                                <version> = "m-" + the first 16 hex digits of the model id

Readers (search, evaluation, the report, the service) resolve the location to the live version
(``resolve``); the embedding job writes the version of its checkpoint's model. A new model's
version is built beside the live one and goes live by ``promote``: the new version must hold every
catalogue the live one holds and pass ``verify``; then ``alias.json`` is rewritten in one write
(an atomic rename locally, one PUT on S3), so a reader sees the old alias or the new one, never a
mix. ``rollback`` makes the previous version live again the same way and holds the version it
left: the embedding job no longer makes a held version live by itself (only an explicit promote
does), so a scheduled run with the newer checkpoint does not undo the rollback. ``retain`` deletes versions
beyond the newest ``index.keep_versions`` (never the live or the previous one).

A location written before versions existed (``manifest.json`` at its root) is still read as one
index; it cannot take a second model (build a new location for versions).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

from puma import storage
from puma.faults import fault_point
from puma.index.layout import ALIAS_FILE, IndexLocation, folder_name
from puma.index.manifest import Manifest, has_manifest, manifest_uri, now, read_manifest
from puma.index.plan import IndexInputError
from puma.index.verify import verify

log = logging.getLogger(__name__)
HISTORY_KEPT = 100


@dataclass
class Alias:
    """Which version is live, which one was before it (the rollback target), and what happened when."""

    live: str
    previous: str = ""
    history: list[dict] = field(default_factory=list)  # {"at", "action", "version", "model_id"}, oldest first
    held: list[str] = field(default_factory=list)  # versions rolled back from: only an explicit promote

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass
class VersionInfo:
    """One version of a location, as ``jobs/index.py versions`` lists it."""

    name: str
    uri: str
    model_id: str
    items: int
    catalogues: list[str]
    created: str
    updated: str
    live: bool = False
    previous: bool = False


def version_name(model_id: str) -> str:
    """The version folder of a model: ``m-`` + 16 hex digits of its id (``m-unknown`` without one)."""
    digits = model_id.rsplit(":", 1)[-1][:16]
    return f"m-{digits}" if digits else "m-unknown"


def version_uri(location: str, version: str) -> str:
    return IndexLocation(location).version(version)


def alias_uri(location: str) -> str:
    return IndexLocation(location).alias


def read_alias(location: str) -> Alias | None:
    """The location's alias, or None when it has none (a new or a pre-versions location)."""
    try:
        data = json.loads(storage.read_text(alias_uri(location)))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise IndexInputError(f"{alias_uri(location)} is not valid JSON ({exc}); restore it with "
                              f"jobs/index.py promote <version>") from exc
    return Alias(**data)


def is_legacy(location: str) -> bool:
    """A location written before versions: one index at its root."""
    return has_manifest(location)


def resolve(location: str) -> str:
    """The index to read at ``location``: its live version, or the location itself (one index)."""
    alias = read_alias(location)
    if alias is not None:
        return version_uri(location, alias.live)
    if not has_manifest(location) and IndexLocation(location).version_folders():
        raise IndexInputError(f"index location {location} has versions but no live one yet "
                              f"(no {ALIAS_FILE}): "
                              f"promote one with `python jobs/index.py promote --version <name>` "
                              f"(list them with `python jobs/index.py versions`)")
    return location


def live_manifest(location: str) -> Manifest | None:
    """The live version's manifest (None when the location has no index yet)."""
    uri = resolve(location)
    return read_manifest(uri) if has_manifest(uri) else None


def recorded_checkpoint(location: str) -> str:
    """The checkpoint the live version's manifest records, when it is still there ('' otherwise)."""
    manifest = live_manifest(location) if storage.exists(location) else None
    ckpt = manifest.checkpoint if manifest is not None else ""
    return ckpt if ckpt and storage.exists(storage.join(ckpt, "config.yaml")) else ""


def list_versions(location: str) -> list[VersionInfo]:
    """Every version with a manifest, oldest first."""
    alias = read_alias(location)
    infos = []
    for folder in IndexLocation(location).version_folders():
        name = folder_name(folder)
        if not has_manifest(folder):
            continue
        m = read_manifest(folder)
        infos.append(VersionInfo(name, folder, m.model_id, m.total, sorted(m.catalogues), m.created,
                                 m.updated,
                                 live=bool(alias and alias.live == name),
                                 previous=bool(alias and alias.previous == name)))
    return sorted(infos, key=lambda v: (v.created, v.name))


def missing_catalogues(location: str, version: str) -> list[str]:
    """Catalogues the live version holds that ``version`` does not (what must be embedded first)."""
    alias = read_alias(location)
    if alias is None or alias.live == version:
        return []
    live = read_manifest(version_uri(location, alias.live))
    candidate = read_manifest(version_uri(location, version))
    return sorted(set(live.catalogues) - set(candidate.catalogues))


def promote(location: str, version: str, keep: int = 0) -> Alias:
    """Make ``version`` live: it must exist, hold every catalogue of the live version and verify."""
    uri = version_uri(location, version)
    if not has_manifest(uri):
        known = [v.name for v in list_versions(location)]
        raise IndexInputError(f"no version {version!r} at {location}; versions: {known}")
    missing = missing_catalogues(location, version)
    if missing:
        raise IndexInputError(f"version {version} lacks {len(missing)} catalogue(s) of the live version, "
                              f"e.g. {missing[:3]}: embed them with its checkpoint first")
    verify(uri).raise_if_bad()
    alias = read_alias(location)
    if alias is not None and alias.live == version:  # already live (e.g. a re-run after a kill)
        if keep:
            retain(location, keep)
        return alias
    manifest = read_manifest(uri)
    new = Alias(live=version, previous=alias.live if alias else "",
                history=_history(alias, "promote", version, manifest.model_id),
                held=[v for v in (alias.held if alias else []) if v != version])
    fault_point("versions.promote")
    storage.write_text(alias_uri(location), new.to_json())
    log.info("index %s: version %s (model %s) is live", location, version, manifest.model_id)
    if keep:
        retain(location, keep)
    return new


def rollback(location: str) -> Alias:
    """Make the previous version live again (it must still exist and verify)."""
    alias = read_alias(location)
    if alias is None or not alias.previous:
        raise IndexInputError(f"index location {location} has no previous version to roll back to")
    uri = version_uri(location, alias.previous)
    if not has_manifest(uri):
        raise IndexInputError(f"the previous version {alias.previous} of {location} was deleted "
                              f"(index.keep_versions); promote another with jobs/index.py promote")
    verify(uri).raise_if_bad()
    new = Alias(live=alias.previous, previous=alias.live,
                history=_history(alias, "rollback", alias.previous, read_manifest(uri).model_id),
                held=sorted({*alias.held, alias.live} - {alias.previous}))
    fault_point("versions.promote")
    storage.write_text(alias_uri(location), new.to_json())
    log.info("index %s: rolled back to version %s", location, alias.previous)
    return new


def retain(location: str, keep: int) -> list[str]:
    """Delete versions beyond the newest ``keep`` (never the live or previous one); returns them."""
    alias = read_alias(location)
    protected = {alias.live, alias.previous} if alias else set()
    versions = list_versions(location)
    doomed = [v for v in versions[:-keep] if v.name not in protected] if keep > 0 else []
    for v in doomed:
        log.info("deleting version %s of %s (index.keep_versions=%d)", v.name, location, keep)
        storage.delete(manifest_uri(v.uri))  # first: from here on it is no version (a kill leaves a folder)
        fault_point("versions.retain")
        storage.delete(v.uri)
    for folder in _unfinished(location, protected):
        storage.delete(folder)
    return [v.name for v in doomed]


def _unfinished(location: str, protected: set[str]) -> list[str]:
    """Version folders without a manifest that are neither live nor previous (a deletion cut short)."""
    folders = IndexLocation(location).version_folders()
    return [f for f in folders if folder_name(f) not in protected and not has_manifest(f)]


def _history(alias: Alias | None, action: str, version: str, model_id: str) -> list[dict]:
    old = alias.history if alias else []
    return [*old, {"at": now(), "action": action, "version": version, "model_id": model_id}][-HISTORY_KEPT:]
