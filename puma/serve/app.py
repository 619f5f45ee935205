"""The Ray Serve application of the search service: its deployments and the app builder.

    HTTP --> SearchIngress   FastAPI: bearer token, body limits, request parsing
                             (puma.serve.requests), query images decoded into the model's eval view;
                             pins every request to one version (model + index) of the location.
                             With serve.ingress=direct it listens on serve.port itself (no proxy).
               |--> QueryModel      the version's checkpoint's model; @serve.batch: images that
               |                    arrive together share one forward; on a GPU when there is one
               |    LocalIndex      serve.index_partitions=1: the whole index in the ingress replica
               |                    (puma.serve.live_index): vector and item-id queries never leave it
               '--> IndexPartition  serve.index_partitions=N>1: N deployments, each holding its
                    x N             shards (puma.serve.partitions; faiss-gpu when on a GPU); a query
                                    fans out to all and their top-k are merged exactly, over each
                                    replica's direct TCP channel (puma.serve.channel; with
                                    serve.partition_channel=ray through deployment handles)

Every replica holding index shards watches the manifest (serve.watch_interval_s) and loads new
shards without a restart.

A new model goes live without a restart: when the location's alias names a new version, the
ingress's watcher asks the model and index to load it beside the old one and only then
pins new requests to it, so a query is always embedded and searched by one model; requests already
running finish on the old version, which the replicas drop after serve.version_grace_s. Every
response names the version and model id that answered.

QueryModel and each IndexPartition autoscale between serve.*_min_replicas and serve.*_max_replicas
on ongoing requests (serve.target_ongoing_requests). An ingress replica works on
serve.max_ongoing_requests at once and queues serve.max_queued_requests more; beyond that a request
gets 503 with Retry-After at once. Routes: ``GET /`` the page, ``POST /search``,
``GET /image?item_id=`` (a thumbnail of an indexed item), ``GET /stats``, ``GET /healthz`` (no
token). Every refusal is JSON ``{"error": "<one line>", "status": N}`` with that HTTP status.

``build`` is the app builder for ``serve run`` and for a KubeRay RayService (import path
``puma.serve.app:build``; args: ``config`` = a YAML file, plus dotted config keys).
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations (Request) at
# run time, and Serve's ingress wrapper cannot resolve postponed (string) ones.
import asyncio
import dataclasses
import hmac
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from importlib import resources

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve
from ray.serve import Application

from puma import storage
from puma.config import Config, IndexConfig
from puma.data.images import ViewSpec, eval_view_spec
from puma.faults import fault_delay
from puma.index.filters import Filter
from puma.index.manifest import read_manifest
from puma.index.versions import read_alias, version_uri
from puma.inference.embedder import Embedder, use_storage
from puma.serve.autoscale import CHANNEL_ONGOING, partition_replicas
from puma.serve.channel import ChannelError
from puma.serve.channel_client import PartitionClient
from puma.serve.channel_server import ChannelServer
from puma.serve.errors import RequestError, as_request_error
from puma.serve.metrics import IndexMetrics, ModelMetrics, ServiceMetrics
from puma.serve.partitions import FanOut, Partition
from puma.serve.plan import ServicePlan, plan_service
from puma.serve.requests import Limits, SearchRequest, image_view, media_type, parse_request
from puma.serve.versions import ServedIndexes

log = logging.getLogger(__name__)
api = FastAPI(title="PUMA search", docs_url=None, redoc_url=None, openapi_url=None)

# Serve pickles the ingress class when it is decorated, with the module globals its methods use
# as they are at that moment: helpers must be defined above the deployments.


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes (declared or sent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body is {declared} bytes; the limit is {limit} "
                                "(serve.max_upload_bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body is over the limit of {limit} bytes "
                                    "(serve.max_upload_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def body_limit(content_type: str, max_upload_bytes: int) -> int:
    """Bytes a body may have: the image limit, plus base64 and form overhead for JSON and forms."""
    if media_type(content_type) in ("application/json", "multipart/form-data"):
        return max_upload_bytes * 4 // 3 + 64 * 1024
    return max_upload_bytes


def unavailable(exc: BaseException) -> RequestError | None:
    """503 for a deployment that cannot answer now (a replica died or restarts, a node was lost, its
    queue is full): the client retries after Retry-After; None for other failures."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    kinds = (ActorDiedError, ActorUnavailableError, RayActorError, BackPressureError,
             DeploymentUnavailableError)
    for candidate in (exc, getattr(exc, "cause", None), exc.__cause__):
        if isinstance(candidate, kinds):
            cause = "backpressure" if isinstance(candidate, BackPressureError) else "replica_unavailable"
            return RequestError(503, "a replica this request needs is unavailable "
                                     f"({type(candidate).__name__}: restarting, or its node was lost); "
                                     "retry after the Retry-After seconds", cause)
    return None


def _params(request: Request) -> dict[str, list[str]]:
    params = request.query_params
    return {name: params.getlist(name) for name in params}


def channel_host() -> str:
    """Where a partition's channel listens: its node's IP in a Ray worker (other nodes reach it there),
    else loopback."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def replica_addresses(handle):
    """``learn`` for a PartitionClient: the channel addresses of every running replica of the partition
    ``handle`` names (IndexPartition.address through Serve's broadcast; replicas that fail to answer
    left out)."""
    async def learn() -> list:
        answers = await handle.broadcast("address").results_async(return_exceptions=True)
        return [a for a in answers if not isinstance(a, BaseException)]
    return learn


@serve.deployment
class QueryModel:
    """Checkpoints' models (the live version's, and the one before it while a switch settles):
    eval views (3, S, S) -> embeddings (E,), batched across requests."""

    MODELS_KEPT = 2

    def __init__(self, checkpoint: str, backbone_weights: str, storage_cfg, use_gpu: bool, threads: int,
                 max_batch_size: int, batch_wait_timeout_s: float, min_image_size: int = 0,
                 runtime: str = "torch", metrics: bool = True) -> None:
        self.options = (backbone_weights, storage_cfg, use_gpu, threads, runtime)
        self.min_image_size = min_image_size
        self.embedders: dict[str, Embedder] = {}
        self._lock = threading.Lock()
        self.default = checkpoint
        self.load(checkpoint)
        self.embed.set_max_batch_size(max_batch_size)
        self.embed.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.batches, self.images, self.largest_batch = 0, 0, 0
        self.metrics = ModelMetrics(enabled=metrics)

    def load(self, checkpoint: str) -> Embedder:
        """The checkpoint's model, loaded once (the oldest of more than MODELS_KEPT dropped)."""
        with self._lock:
            if checkpoint not in self.embedders:
                self.embedders[checkpoint] = Embedder(checkpoint, *self.options)
                while len(self.embedders) > self.MODELS_KEPT:
                    self.embedders.pop(next(iter(self.embedders)))
            return self.embedders[checkpoint]

    async def prepare(self, checkpoint: str) -> ViewSpec:
        """Load ``checkpoint`` (off the event loop) and return its eval view for query images."""
        from puma.checkpoint import read_checkpoint

        await asyncio.get_running_loop().run_in_executor(None, self.load, checkpoint)
        state = await asyncio.get_running_loop().run_in_executor(None, read_checkpoint, checkpoint)
        return eval_view_spec(state.config, min_size=self.min_image_size)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def embed(self, views: list[np.ndarray], checkpoints: list[str]) -> list[np.ndarray]:
        """One forward per model for every view that arrived together: B x (3, S, S) -> B x (E,)."""
        out: list = [None] * len(views)
        loop = asyncio.get_running_loop()
        for checkpoint in dict.fromkeys(c or self.default for c in checkpoints):
            rows = [i for i, c in enumerate(checkpoints) if (c or self.default) == checkpoint]
            embedder = await loop.run_in_executor(None, self.load, checkpoint)
            batch = np.stack([views[i] for i in rows])  # (B, 3, S, S)
            emb = await loop.run_in_executor(None, embedder.forward, batch)  # (B, E)
            for i, e in zip(rows, emb, strict=True):
                out[i] = e
        self.batches, self.images = self.batches + 1, self.images + len(views)
        self.largest_batch = max(self.largest_batch, len(views))
        self.metrics.batch(len(views))
        return out

    def stats(self) -> dict:
        """Batches run, images embedded, the largest batch, the device, the models loaded (this replica)."""
        device = str(next(iter(self.embedders.values())).device) if self.embedders else ""
        return {"batches": self.batches, "images": self.images, "largest_batch": self.largest_batch,
                "device": device, "checkpoints": list(self.embedders), "runtime": self.options[4]}


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


@dataclass(frozen=True)
class Pinned:
    """What one request is answered by: a version of the location, its model id and checkpoint."""

    version: str
    model_id: str
    checkpoint: str
    view: ViewSpec | None


@serve.deployment
@serve.ingress(api)
class SearchIngress:
    """HTTP: the page, search, thumbnails, stats and health; refusals as one-line JSON errors."""

    def __init__(self, partitions: list | None, local: dict, model, pinned: Pinned, limits: Limits,
                 token_env: str, location: str = "", storage_cfg=None, watch_interval_s: float = 10.0,
                 timeout_s: float = 5.0, channel_token: str = "", metrics: bool = True) -> None:
        # partitions: the IndexPartition deployments' handles (channel_token: their direct channels'); none:
        # this replica holds the index (local: LocalIndex's arguments)
        self.index = (PartitionedIndex(partitions, timeout_s, channel_token) if partitions
                      else LocalIndex(**local))
        self.model, self.limits = model, limits
        self.token_env, self.token = token_env, os.environ.get(token_env, "")
        self.pinned, self.location = pinned, location
        self.page = resources.files("puma.serve").joinpath("page.html").read_text()
        self.metrics = ServiceMetrics(enabled=metrics)
        self.metrics.live(pinned.version, pinned.model_id)
        self.index.timer = self.metrics.stage  # the partitions' merge time
        self._stop = threading.Event()
        if pinned.version:  # a location with versions: follow its alias
            use_storage(storage_cfg)
            threading.Thread(target=self._follow, args=(watch_interval_s,), name="alias", daemon=True).start()

    def _follow(self, interval: float) -> None:
        """Pin new requests to the alias's version once the model and index deployments have loaded it."""
        while not self._stop.wait(interval):
            try:
                alias = read_alias(self.location)
                if alias is not None and alias.live != self.pinned.version:
                    self.pinned = self._prepare(alias.live)
                    self.metrics.live(self.pinned.version, self.pinned.model_id)
                    log.info("answering with version %s (model %s)", self.pinned.version,
                             self.pinned.model_id)
            except Exception:  # noqa: BLE001 - keep answering with the pinned version; retry next tick
                log.exception("following the alias of %s failed; still answering with version %s",
                              self.location, self.pinned.version)

    def _prepare(self, version: str) -> Pinned:
        manifest = read_manifest(version_uri(self.location, version))
        view = None
        if self.model is not None:
            view = self.model.prepare.remote(manifest.checkpoint).result()
        self.index.prepare(version)
        return Pinned(version, manifest.model_id, manifest.checkpoint, view)

    @api.get("/", response_class=HTMLResponse)
    async def page_route(self) -> HTMLResponse:
        return HTMLResponse(self.page)

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        return await self._respond("/healthz", self._health)

    @api.get("/stats")
    async def stats(self, request: Request) -> JSONResponse:
        return await self._respond("/stats", self._stats, request)

    @api.post("/search")
    async def search(self, request: Request) -> JSONResponse:
        return await self._respond("/search", self._search, request)

    @api.get("/image")
    async def image(self, request: Request) -> Response:
        return await self._respond("/image", self._image, request)

    # ------------------------------------------------------------------------- the routes' work

    async def _respond(self, route: str, work, request: Request | None = None) -> Response:
        """Run a route; a RequestError (here or in a deployment) becomes its status and one-line JSON.
        Every answer is counted and timed (puma/serve/metrics.py)."""
        start = time.perf_counter()
        response = await self._answer(work, request)
        kind = getattr(request.state, "kind", "") if request is not None else ""
        self.metrics.request(route, kind, response.status_code, time.perf_counter() - start)
        return response

    async def _answer(self, work, request: Request | None) -> Response:
        try:
            result = await (work() if request is None else work(request))
        except Exception as exc:  # noqa: BLE001 - every failure gets a JSON answer
            error = as_request_error(exc) or unavailable(exc)
            if error is None:
                log.exception("internal error")
                error = RequestError(500, f"internal error: {type(exc).__name__}; see the replica's log")
            headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
            if error.status == 503:
                headers = {"Retry-After": f"{math.ceil(self.limits.retry_after_s)}"}
                self.metrics.refusal(error.cause)
            return JSONResponse(error.to_dict(), status_code=error.status, headers=headers)
        return result if isinstance(result, Response) else JSONResponse(result)

    async def _health(self) -> dict:
        health = await self.index.health_async()
        return {"status": "ok", "items": health["items"], "auth": bool(self.token),
                "image_queries": self.model is not None, "version": self.pinned.version,
                "model_id": self.pinned.model_id}

    async def _stats(self, request: Request) -> dict:
        self._authorise(request)
        stats = {"index": await self.index.stats_async(), "auth": bool(self.token),
                 "version": self.pinned.version, "model_id": self.pinned.model_id,
                 "image_queries": self.model is not None, "limits": dataclasses.asdict(self.limits)}
        if self.model is not None:
            stats["model"] = await self.model.stats.remote()
        return stats

    async def _search(self, request: Request) -> dict:
        self._authorise(request)
        start = time.perf_counter()
        content_type = request.headers.get("content-type", "")
        body = await read_body(request, body_limit(content_type, self.limits.max_upload_bytes))
        query = parse_request(content_type, body, _params(request), self.limits)
        request.state.kind = query.kind
        await fault_delay("serve.search")
        pinned = self.pinned  # one version answers the whole request
        hits = await self._hits(query, pinned)
        if query.where is not None:  # counted once answered: a refused filter's columns are not the table's
            self.metrics.filtered(query.where.columns())
        return {"query": query.describe(), "hits": hits, "model_id": pinned.model_id,
                "version": pinned.version, "took_ms": round(1000 * (time.perf_counter() - start), 2)}

    async def _hits(self, query: SearchRequest, pinned: Pinned) -> list[dict]:
        if query.kind == "item_id":
            start = time.perf_counter()
            hits = await self.index.search_item(query.item_id, query.k, query.datasets, query.catalogues,
                                                query.include_self, query.where, pinned.version)
            self.metrics.stage("index", time.perf_counter() - start)
            return hits
        vector = query.vector
        if query.kind == "image":
            if self.model is None:
                raise RequestError(400, "image queries are off on this service (serve.image_queries=false); "
                                        "send an item_id or a vector")
            view = await asyncio.to_thread(image_view, query.image, pinned.view, self.limits.max_image_pixels)
            start = time.perf_counter()
            vector = await self.model.embed.remote(view, pinned.checkpoint)
            self.metrics.stage("model", time.perf_counter() - start)
        start = time.perf_counter()
        hits = await self.index.search_vector(vector, query.k, query.datasets, query.catalogues,
                                              query.where, pinned.version)
        self.metrics.stage("index", time.perf_counter() - start)
        return hits

    async def _image(self, request: Request) -> Response:
        self._authorise(request)
        item_id = request.query_params.get("item_id", "")
        if not item_id:
            raise RequestError(400, "give the item: GET /image?item_id=<an indexed item id>")
        data = await self.index.thumbnail(item_id, self.pinned.version)
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=3600"})

    def _authorise(self, request: Request) -> None:
        """401 unless the request carries ``Authorization: Bearer <token>`` (when a token is set)."""
        if not self.token:
            return
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
            raise RequestError(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                                    f"with the service's token (${self.token_env} where it runs)")


# ----------------------------------------------------------------------------- building the app


def build_app(plan: ServicePlan) -> Application:
    """The application for a checked plan: the model deployment, and the index in the ingress or in
    plan.partitions partition deployments, behind the HTTP ingress."""
    cfg, s = plan.cfg, plan.cfg.serve
    use_gpu = gpus_wanted(cfg)
    options = deployment_options(cfg, use_gpu)
    index_cfg = dataclasses.replace(cfg.index, use_gpu=cfg.index.use_gpu and use_gpu)
    index_args = {"index_cfg": index_cfg, "dim": plan.manifest.dim, "storage_cfg": storage.current_config(),
                  "watch_interval_s": s.watch_interval_s, "grace_s": s.version_grace_s, "metrics": s.metrics}
    partitions = None
    # the partitions' direct channels admit the holders of this app's token (a new one per build)
    token = secrets.token_urlsafe(24) if plan.partitions > 1 and s.partition_channel == "direct" else ""
    if plan.partitions > 1:
        threads = max(2, math.ceil(s.index_num_cpus))  # FAISS releases the GIL: searches overlap
        partitions = [IndexPartition.options(**options["index"], name=f"index-{p}").bind(
            **index_args, partition=Partition(p, plan.partitions), channel_token=token,
            channel_threads=threads) for p in range(plan.partitions)]
    model = None
    if s.image_queries:
        model = QueryModel.options(**options["model"]).bind(
            plan.checkpoint, cfg.embed.backbone_weights, storage.current_config(), use_gpu,
            max(1, int(s.model_num_cpus)), s.max_batch_size, s.batch_wait_timeout_s, cfg.data.min_image_size,
            s.runtime, s.metrics)
    pinned = Pinned(plan.version, plan.model_id, plan.checkpoint, plan.view)
    local = {} if partitions else {**index_args, "index_cfg": dataclasses.replace(cfg.index, use_gpu=False)}
    return SearchIngress.options(**options["ingress"]).bind(
        partitions, local, model, pinned, Limits.from_config(s), s.token_env, cfg.index.uri,
        storage.current_config(), s.watch_interval_s, s.partition_timeout_s, token, s.metrics)


def deployment_options(cfg: Config, use_gpu: bool) -> dict[str, dict]:
    """Replicas, autoscaling, resources and load limits of the deployments (GPUs only when ``use_gpu``)."""
    s = cfg.serve
    index_scaling = _autoscaling(s.index_min_replicas, s.index_max_replicas, s.target_ongoing_requests)
    # Serve's rule over the handles' requests and the direct channels' (which it does not see)
    index_scaling["policy"] = {"policy_function": partition_replicas}
    # a model replica is busy, not overloaded, with a full batch in flight: scale past that
    model_scaling = _autoscaling(s.model_min_replicas, s.model_max_replicas, float(s.max_batch_size))
    ingress = {"name": "ingress", "num_replicas": s.ingress_replicas,
               "max_ongoing_requests": s.max_ongoing_requests, "max_queued_requests": s.max_queued_requests,
               "backpressure_config": {"status_code": 503, "retry_after_s": s.retry_after_s},
               "ray_actor_options": {**_resources(s.ingress_num_cpus, 0.0),
                                     **({"resources": s.ingress_resources} if s.ingress_resources else {})}}
    if s.ingress == "direct":
        ingress["max_replicas_per_node"] = 1  # each listens on serve.port of its node
    return {
        "index": {"autoscaling_config": index_scaling, "max_ongoing_requests": 16,
                  "ray_actor_options": {**_resources(s.index_num_cpus, s.index_num_gpus if use_gpu else 0.0),
                                        **({"resources": s.index_resources} if s.index_resources else {})}},
        "model": {"name": "model", "autoscaling_config": model_scaling,
                  "max_ongoing_requests": max(2 * s.max_batch_size, 8),  # room to fill a batch and queue one
                  "ray_actor_options": _resources(s.model_num_cpus, s.model_num_gpus if use_gpu else 0.0)},
        "ingress": ingress,
    }


def build(args: dict[str, str]) -> Application:
    """App builder for ``serve run puma.serve.app:build config=FILE key=value ...`` and RayService:
    ``config`` names the YAML config (default $PUMA_CONFIG, else configs/demo.yaml), every other arg is
    a dotted key."""
    from puma.cli import default_config
    from puma.methods import load_config

    args = dict(args or {})
    path = args.pop("config", "") or default_config()
    cfg = load_config(path, [f"{key}={value}" for key, value in args.items()])
    return build_app(plan_service(cfg))


def gpus_wanted(cfg: Config) -> bool:
    """serve.gpu: always, never, or auto (when the Ray cluster has GPUs now)."""
    if cfg.serve.gpu != "auto":
        return cfg.serve.gpu == "always"
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def _autoscaling(low: int, high: int, target: float) -> dict:
    return {"min_replicas": low, "initial_replicas": low, "max_replicas": high,
            "target_ongoing_requests": target}


def _resources(cpus: float, gpus: float) -> dict:
    return {"num_cpus": cpus, **({"num_gpus": gpus} if gpus > 0 else {})}
