"""The replicas that hold index shards: each keeps its ServedIndexes (puma.serve.versions) current
from a watch thread, and answers queries from them.

    Watched         a replica's served versions and the thread that refreshes them every
                    serve.watch_interval_s: new shards and a new live version load without a restart
    LocalIndex      serve.index_partitions=1: the whole index inside the ingress replica; vector and
                    item-id queries never leave it, and unfiltered ones that wait together share one
                    FAISS call
    IndexPartition  serve.index_partitions=N>1: the deployment holding one partition's shards
                    (puma.serve.partitions), answering the ingress's fan-out (puma.serve.fanout) through
                    its handle and on a direct channel of its own (puma.serve.channel_server)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np
from ray import serve

from puma.config import IndexConfig
from puma.index.filters import Filter
from puma.inference.embedder import use_storage
from puma.serve.autoscale import CHANNEL_ONGOING
from puma.serve.channel_server import ChannelServer
from puma.serve.errors import RequestError
from puma.serve.metrics import IndexMetrics
from puma.serve.partitions import Partition
from puma.serve.versions import ServedIndexes

log = logging.getLogger(__name__)


def channel_host() -> str:
    """Where a partition's channel listens: its node's IP in a Ray worker (other nodes reach it there),
    else loopback."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


class Watched:
    """A replica's ServedIndexes (every shard, or one partition's) with the thread that refreshes it
    every watch_interval_s: new shards and a new live version are loaded without a restart."""

    def __init__(self, index_cfg: IndexConfig, dim: int, storage_cfg, watch_interval_s: float,
                 grace_s: float, partition: Partition = Partition(), metrics: bool = True) -> None:
        use_storage(storage_cfg)
        self.served = ServedIndexes(index_cfg, dim, grace_s, partition)
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.metrics = IndexMetrics(partition.index, enabled=metrics)
        self.metrics.served(self.served.figures())
        self._stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(watch_interval_s,), name="watch", daemon=True)
        watcher.start()

    def _watch(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.served.refresh()
                self.metrics.served(self.served.figures())
            except Exception:  # noqa: BLE001 - a storage hiccup must not stop the watch; the next tick retries
                log.exception("reading the index at %s failed; serving what is loaded", self.served.location)

    def prepare(self, version: str) -> int:
        """Load ``version`` now (before requests are pinned to it; blocking); its items."""
        return self.served.get(version).state.items

    def stats(self) -> dict:
        """The served index's stats, and which replica answered since when (a restart changes both)."""
        replica = serve.get_replica_context().replica_id.unique_id
        return {**self.served.get().stats(), "live_version": self.served.live,
                "loaded_versions": self.served.loaded, "replica": replica,
                "replica_started_at": self.started_at}

    def health(self) -> dict:
        live = self.served.get()
        return {"items": live.state.items, "refused_update": live.refused, "version": self.served.live}

    def stop(self) -> None:
        self._stop.set()


class LocalIndex(Watched):
    """The whole index inside the ingress replica (serve.index_partitions=1): vector and item-id
    queries are searched in the process that parsed them, with no actor hop."""

    async def search_vector(self, vector: np.ndarray, k: int, datasets: tuple, catalogues: tuple,
                            where: Filter | None, version: str) -> list[dict]:
        """Filtered queries one by one; unfiltered ones that wait together share one FAISS call."""
        if datasets or catalogues or where is not None:
            with self.served.use(version) as live:
                return live.search_vector(vector, k, datasets, catalogues, where)
        self.served.get(version).check_vector(vector)  # a wrong length fails alone, not its batch
        return await self._together(vector, k, version)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.0)
    async def _together(self, vectors: list, ks: list, versions: list) -> list[list[dict]]:
        """The unfiltered queries waiting now (none waits for more): one search per version, trimmed to
        each query's k (identical to searching each alone)."""
        out: list = [None] * len(vectors)
        for version in dict.fromkeys(versions):
            rows = [i for i, v in enumerate(versions) if v == version]
            with self.served.use(version) as live:
                hits = live.search_vectors([vectors[i] for i in rows], max(ks[i] for i in rows))
            for i, found in zip(rows, hits, strict=True):
                out[i] = found[:ks[i]]
        return out

    async def search_item(self, item_id: str, k: int, datasets: tuple, catalogues: tuple,
                          include_self: bool, where: Filter | None, version: str) -> list[dict]:
        with self.served.use(version) as live:
            return live.search_item(item_id, k, datasets, catalogues, include_self, where)

    async def thumbnail(self, item_id: str, version: str) -> bytes:
        with self.served.use(version) as live:
            return await asyncio.to_thread(live.thumbnail, item_id)

    async def stats_async(self) -> dict:
        return self.stats()

    async def health_async(self) -> dict:
        return self.health()


@serve.deployment
class IndexPartition:
    """One partition of the index (serve.index_partitions > 1): the shards puma.serve.partitions
    assigns it, searched with filters; the ingress fans a query out to every partition and merges.
    With a ``channel_token`` it also answers search_part and vector_of on a direct channel of its own
    (puma.serve.channel: a thread of this replica, its node's IP, an ephemeral port)."""

    def __init__(self, index_cfg: IndexConfig, dim: int, storage_cfg, watch_interval_s: float,
                 grace_s: float, partition: Partition, channel_token: str = "",
                 channel_threads: int = 2, metrics: bool = True) -> None:
        self.index = Watched(index_cfg, dim, storage_cfg, watch_interval_s, grace_s, partition, metrics)
        self.channel = None
        if channel_token:
            self.channel = ChannelServer({"search_part": self._search_part_sent, "vector_of": self.vector_of},
                                         channel_token, channel_host(), channel_threads,
                                         batched={"search_part": self._search_parts_sent})
            self.channel.start()

    def address(self) -> list:
        """[host, port] of this replica's direct channel (the ingress asks every replica, via the handle)."""
        if self.channel is None:
            raise RequestError(503, "this index partition has no direct channel "
                                    "(serve.partition_channel=ray)")
        return list(self.channel.address)

    def check_health(self) -> None:
        """Serve replaces a replica whose channel stopped (it could no longer answer queries)."""
        if self.channel is not None and not self.channel.running():
            raise RuntimeError(f"the partition channel at {self.channel.address} stopped")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The channel's requests in flight for the autoscaler (puma.serve.autoscale; Serve sees the
        handles' by itself)."""
        return {CHANNEL_ONGOING: self.channel.ongoing() if self.channel is not None else 0.0}

    def prepare(self, version: str) -> int:
        return self.index.prepare(version)

    def search_part(self, vector: np.ndarray, k: int, datasets: tuple, catalogues: tuple,
                    where: dict | None, version: str) -> dict:
        """One partition's answer (``where``: a filter's JSON form, as the wire carries it)."""
        with self.index.served.use(version) as live:
            return live.search_part(vector, k, datasets, catalogues, where)

    def _search_part_sent(self, vector: np.ndarray, k: int, datasets: list, catalogues: list,
                          where: dict | None, version: str) -> dict:
        """search_part as the channel calls it (its frames carry tuples as lists)."""
        return self.search_part(vector, int(k), tuple(datasets), tuple(catalogues), where, version)

    def _search_parts_sent(self, calls: list[list]) -> list:
        """Many channel search_part calls at once: the unfiltered ones of each version share one FAISS
        search (trimmed to each call's k: the same hits as alone); the others run one by one."""
        out: list = [None] * len(calls)
        plain = [i for i, call in enumerate(calls) if not call[2] and not call[3] and call[4] is None]
        for version in dict.fromkeys(calls[i][5] for i in plain):  # unfiltered: one search per version
            rows = [i for i in plain if calls[i][5] == version]
            try:
                with self.index.served.use(version) as live:
                    answers = live.search_parts([calls[i][0] for i in rows],
                                                max(int(calls[i][1]) for i in rows))
            except RequestError:
                continue  # e.g. one vector of a wrong length: each call gets its own answer below
            for i, answer in zip(rows, answers, strict=True):
                out[i] = {**answer, "hits": answer["hits"][:int(calls[i][1])]}
        for i, call in enumerate(calls):
            if out[i] is None:
                try:
                    out[i] = self._search_part_sent(*call)
                except RequestError as exc:
                    out[i] = exc
        return out

    def vector_of(self, item_id: str, version: str) -> np.ndarray | None:
        with self.index.served.use(version) as live:
            return live.vector_of(item_id)

    def thumbnail(self, item_id: str, version: str) -> bytes | None:
        """The item's thumbnail, None when this partition does not hold the item."""
        with self.index.served.use(version) as live:
            return live.thumbnail(item_id) if live.holds(item_id) else None

    def stats(self) -> dict:
        """The partition's stats, with its channel's address and the queries it answered (this replica)."""
        stats = self.index.stats()
        if self.channel is not None:
            host, port = self.channel.address
            stats["channel"] = {"address": f"{host}:{port}", "requests": self.channel.requests}
        return stats

    def health(self) -> dict:
        return self.index.health()

    def __del__(self) -> None:
        self.index.stop()
        if self.channel is not None:
            self.channel.stop()
