"""Which version of the index location a replica serves: the location's alias names the live version
(model and index, puma.index.versions), and the replica follows it from one version to the next
without a restart.

``ServedIndexes`` holds the live version's LiveIndex, and the one before it while requests that started
on it finish (dropped after serve.version_grace_s). No Ray here.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

from puma.config import IndexConfig
from puma.index.manifest import has_manifest
from puma.index.versions import read_alias, version_uri
from puma.serve.errors import RequestError
from puma.serve.live_index import LiveIndex
from puma.serve.partitions import Partition

log = logging.getLogger(__name__)


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
                uri = version_uri(self.location, version) if version else self.location
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
