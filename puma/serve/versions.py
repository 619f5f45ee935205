"""Which version of the index location answers: the location's alias names the live version (model and
index, puma.index.versions), and the service follows it from one version to the next without a restart.

    ServedIndexes   in each replica holding shards: the live version's LiveIndex, and the one before it
                    while requests that started on it finish (dropped after serve.version_grace_s)
    AliasFollower   in the ingress: the version new requests are pinned to (``Pinned``), moved to the
                    alias's once the model and index deployments have loaded it, so a query is always
                    embedded and searched by one model

No Ray here: the follower calls the deployments it is given (QueryModel.prepare through its handle,
the index holder's ``prepare``).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from puma.config import IndexConfig
from puma.data.images import ViewSpec
from puma.index.layout import IndexLocation
from puma.index.manifest import has_manifest, read_manifest
from puma.index.versions import read_alias, version_uri
from puma.inference.embedder import use_storage
from puma.serve.errors import RequestError
from puma.serve.live_index import LiveIndex
from puma.serve.partitions import Partition

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pinned:
    """What one request is answered by: a version of the location, its model id and checkpoint."""

    version: str
    model_id: str
    checkpoint: str
    view: ViewSpec | None


class AliasFollower:
    """The version the ingress pins new requests to (``pinned``): every ``interval`` s a thread reads the
    location's alias and, when it names a new version, has ``model`` (a QueryModel handle, or None) and
    ``index`` (LocalIndex or PartitionedIndex) load it before pinning to it; ``on_switch(version,
    model_id)`` is told each switch. A location without versions (``pinned.version`` '') is not followed."""

    def __init__(self, pinned: Pinned, location: str, model, index, storage_cfg=None,
                 interval: float = 10.0, on_switch=None) -> None:
        self.pinned, self.location = pinned, location
        self.model, self.index, self.on_switch = model, index, on_switch
        self._stop = threading.Event()
        if pinned.version:  # a location with versions: follow its alias
            use_storage(storage_cfg)
            threading.Thread(target=self._follow, args=(interval,), name="alias", daemon=True).start()

    def _follow(self, interval: float) -> None:
        """Pin new requests to the alias's version once the model and index deployments have loaded it."""
        while not self._stop.wait(interval):
            try:
                alias = read_alias(self.location)
                if alias is not None and alias.live != self.pinned.version:
                    self.pinned = self._prepare(alias.live)
                    if self.on_switch is not None:
                        self.on_switch(self.pinned.version, self.pinned.model_id)
                    log.info("answering with version %s (model %s)", self.pinned.version,
                             self.pinned.model_id)
            except Exception:  # noqa: BLE001 - keep answering with the pinned version; retry next tick
                log.exception("following the alias of %s failed; still answering with version %s",
                              self.location, self.pinned.version)

    def _prepare(self, version: str) -> Pinned:
        """Load ``version`` in the model and index deployments (blocking); what requests pinned to it use."""
        manifest = read_manifest(version_uri(self.location, version))
        view = None
        if self.model is not None:
            view = self.model.prepare.remote(manifest.checkpoint).result()
        self.index.prepare(version)
        return Pinned(version, manifest.model_id, manifest.checkpoint, view)

    def stop(self) -> None:
        self._stop.set()


class ServedIndexes:
    """The versions a replica serves: the live one named by the location's alias, and the one before it
    while requests that started on it finish (a location without versions: one LiveIndex, version '').

    ``get(version)`` loads a version on first use, so a request pinned to a version this replica has
    not loaded yet (another replica switched first) is still answered by that version."""

    def __init__(self, cfg: IndexConfig, dim: int, grace_s: float = 30.0,
                 partition: Partition = Partition()) -> None:
        self.cfg, self.dim, self.grace_s, self.partition = cfg, dim, grace_s, partition
        self.location = cfg.uri
        self._lock = threading.RLock()
        self._loaded: dict[str, LiveIndex] = {}
        self._in_flight: dict[str, int] = {}
        self._retired: dict[str, float] = {}  # version -> when it stopped being live
        self.live = self._live_name()
        self.get(self.live)

    def _live_name(self) -> str:
        alias = read_alias(self.location)
        return alias.live if alias is not None else ""

    def get(self, version: str | None = None) -> LiveIndex:
        """The LiveIndex of ``version`` (default: the live one), loaded if this replica has not yet."""
        version = self.live if version is None else version
        with self._lock:
            if version not in self._loaded:
                uri = IndexLocation(self.location).index(version)
                if version and not has_manifest(uri):
                    raise RequestError(409, f"version {version} of {self.location} no longer exists; "
                                            "send the request again")
                self._loaded[version] = LiveIndex(self.cfg, None, self.dim, uri=uri, version=version,
                                                  partition=self.partition)
                log.info("loaded version %s of %s", version or "(single index)", self.location)
            return self._loaded[version]

    @contextmanager
    def use(self, version: str | None = None):
        """The LiveIndex of ``version`` held for one request (a retired version is not dropped while
        a request holds it)."""
        index = self.get(version)
        with self._lock:
            self._in_flight[index.version] = self._in_flight.get(index.version, 0) + 1
        try:
            yield index
        finally:
            with self._lock:
                self._in_flight[index.version] -= 1

    def refresh(self) -> bool:
        """Follow the alias (load a new live version beside the old), refresh what is loaded, drop
        retired versions no request holds after the grace period; True when the live version changed."""
        live = self._live_name()
        switched = live != self.live
        if switched:
            self.get(live)  # loaded before it is served
            with self._lock:
                self._retired[self.live] = time.monotonic()
                self._retired.pop(live, None)
                self.live = live
            log.info("index %s: serving version %s", self.location, live)
        for index in list(self._loaded.values()):
            index.refresh()
        self._drop_retired()
        return switched

    def _drop_retired(self) -> None:
        now_s = time.monotonic()
        with self._lock:
            for version, since in list(self._retired.items()):
                if now_s - since >= self.grace_s and not self._in_flight.get(version, 0):
                    self._loaded.pop(version, None)
                    self._retired.pop(version)
                    log.info("dropped version %s of %s", version, self.location)

    @property
    def loaded(self) -> list[str]:
        return sorted(self._loaded)

    def figures(self) -> dict[str, tuple[int, int, int, str]]:
        """Each loaded version's items, shards, removed rows and manifest ``updated`` (for metrics)."""
        with self._lock:
            return {version: (live.state.items, len(live.state.manifest.shards), live.state.manifest.removed,
                              live.state.manifest.updated) for version, live in self._loaded.items()}
