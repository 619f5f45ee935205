"""The fan-out: a query asked of every index partition at once and their answers merged exactly
(puma.serve.partitions: merged_answer, merged_stats), in the ingress (serve.index_partitions > 1).

``FanOut`` is the fan-out over any partitions (the tests' hold LiveIndexes in this process);
``PartitionedIndex`` is the ingress's: the IndexPartition deployments (puma.serve.holders), reached
over each replica's direct channel (puma.serve.channel_client) for a query's calls and through the
deployment handles for the rest (with serve.partition_channel=ray, for all of them).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from puma.index.filters import Filter
from puma.serve.channel import ChannelError
from puma.serve.channel_client import PartitionClient
from puma.serve.errors import RequestError
from puma.serve.partitions import merged_answer, merged_stats


def replica_addresses(handle):
    """``learn`` for a PartitionClient: the channel addresses of every running replica of the partition
    ``handle`` names (IndexPartition.address through Serve's broadcast; replicas that fail to answer
    left out)."""
    async def learn() -> list:
        answers = await handle.broadcast("address").results_async(return_exceptions=True)
        return [a for a in answers if not isinstance(a, BaseException)]
    return learn


def _wire(where: Filter | None) -> dict | None:
    """A filter as the partitions' calls carry it: its canonical JSON form."""
    return None if where is None else where.to_json()


class FanOut:
    """Queries answered by every partition and merged: ``_all(method, *args)`` calls ``method`` of
    each partition (IndexPartition's methods: search_part, vector_of, thumbnail, stats, health)
    with the request's version last, and returns their answers in partition order. ``timer(stage,
    seconds)``, when set, is told each merge's time (the service's metrics)."""

    timer = None

    async def _all(self, method: str, *args) -> list:
        raise NotImplementedError

    async def search_vector(self, vector: np.ndarray, k: int, datasets: tuple, catalogues: tuple,
                            where: Filter | None, version: str) -> list[dict]:
        answers = await self._all("search_part", vector, k, datasets, catalogues, _wire(where), version)
        return self._merged(answers, k)

    async def search_item(self, item_id: str, k: int, datasets: tuple, catalogues: tuple,
                          include_self: bool, where: Filter | None, version: str) -> list[dict]:
        """The partition holding the item gives its vector; every partition searches it (one more
        hit each unless include_self) and the item itself leaves the merge."""
        vector = next((v for v in await self._all("vector_of", item_id, version) if v is not None), None)
        if vector is None:
            raise RequestError(404, f"unknown item id {item_id!r}: it is not in the index")
        answers = await self._all("search_part", vector, k + (0 if include_self else 1), datasets,
                                  catalogues, _wire(where), version)
        return self._merged(answers, k, "" if include_self else item_id)

    def _merged(self, answers: list, k: int, leave_out: str = "") -> list[dict]:
        start = time.perf_counter()
        hits = merged_answer(answers, k, leave_out)
        if self.timer is not None:
            self.timer("merge", time.perf_counter() - start)
        return hits

    async def thumbnail(self, item_id: str, version: str) -> bytes:
        data = next((d for d in await self._all("thumbnail", item_id, version) if d is not None), None)
        if data is None:
            raise RequestError(404, f"unknown item id {item_id!r}: it is not in the index")
        return data

    async def stats_async(self) -> dict:
        return merged_stats(await self._all("stats"))

    async def health_async(self) -> dict:
        parts = await self._all("health")
        return {"items": sum(p["items"] for p in parts), "version": parts[0]["version"],
                "refused_update": next((p["refused_update"] for p in parts if p["refused_update"]), "")}


class PartitionedIndex(FanOut):
    """The ingress's view of the IndexPartition deployments (puma.serve.partitions.FanOut): every query
    goes to all of them at once and their top-k are merged exactly. With a ``channel_token``, the
    query's calls (search_part, vector_of) go over the partitions' direct channels, the rest (stats,
    health, thumbnails, prepare) through the handles."""

    DIRECT = ("search_part", "vector_of")

    def __init__(self, handles: list, timeout_s: float, channel_token: str = "",
                 learn=replica_addresses) -> None:
        # learn(handle) -> an async function giving the addresses of the partition's replicas' channels
        self.handles, self.timeout_s, self.learn = handles, timeout_s, learn
        self.channel_token = channel_token
        self._channels: dict = {}  # event loop -> a PartitionClient per partition (connections live on one)

    async def _all(self, method: str, *args) -> list:
        """Every partition's answer; 503 when one does not answer within serve.partition_timeout_s (its
        node lost, its replica restarting: Serve would hold the call until a replica is back)."""
        if self.channel_token and method in self.DIRECT:
            return list(await asyncio.gather(*(self._direct(c, method, args) for c in self._clients())))
        calls = [getattr(h, method).remote(*args) for h in self.handles]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*calls), self.timeout_s))
        except asyncio.TimeoutError:
            for call in calls:
                call.cancel()
            raise RequestError(503, f"an index partition did not answer within {self.timeout_s:g} s "
                                    "(serve.partition_timeout_s: its node lost or its replica restarting); "
                                    "retry after the Retry-After seconds", "partition_timeout") from None

    async def _direct(self, client: PartitionClient, method: str, args: tuple):
        """One partition's answer over its channel; 503 when it cannot answer or not in time."""
        try:
            return await client.call(method, args, self.timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(503, f"index partition {client.name} did not answer within "
                                    f"{self.timeout_s:g} s (serve.partition_timeout_s: its node lost or its "
                                    "replica restarting); retry after the Retry-After seconds",
                               "partition_timeout") from None
        except ChannelError as exc:
            raise RequestError(503, f"index partition {client.name} is unavailable ({exc}: its replica "
                                    "restarting, or its node lost); retry after the Retry-After seconds",
                               "replica_unavailable") from None

    def _clients(self) -> list[PartitionClient]:
        loop = asyncio.get_running_loop()
        if loop not in self._channels:
            self._channels[loop] = [PartitionClient(f"index-{p}", self.learn(h), self.channel_token,
                                                    learn_timeout_s=self.timeout_s)
                                    for p, h in enumerate(self.handles)]
        return self._channels[loop]

    def prepare(self, version: str) -> int:
        """Every partition loads ``version`` (from the alias thread, blocking); the index's items."""
        return sum(h.prepare.remote(version).result() for h in self.handles)

