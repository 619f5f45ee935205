"""The search service's HTTP ingress (a Ray Serve deployment with FastAPI): bearer token, body limits
and request parsing (puma.serve.http, puma.serve.requests), query images decoded into the model's
eval view; every request pinned to one version (model + index) of the location (puma.serve.versions).

Routes: ``GET /`` the page, ``POST /search``, ``GET /image?item_id=`` (a thumbnail of an indexed
item), ``GET /stats``, ``GET /healthz`` (no token). Every refusal is JSON ``{"error": "<one line>",
"status": N}`` with that HTTP status; a deployment that cannot answer now gives 503 with Retry-After.
Every answer is counted and timed (puma.serve.metrics).

The index is in this replica (LocalIndex, serve.index_partitions=1) or fanned out to the partition
deployments (PartitionedIndex, puma.serve.fanout); image queries are embedded by the QueryModel
deployment (puma.serve.query_model).
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations (Request) at
# run time, and Serve's ingress wrapper cannot resolve postponed (string) ones.
import asyncio
import dataclasses
import logging
import os
import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve

from puma.faults import fault_delay
from puma.serve.errors import RequestError
from puma.serve.fanout import PartitionedIndex
from puma.serve.holders import LocalIndex
from puma.serve.http import authorise, body_limit, error_response, internal_error, params, read_body, refusal
from puma.serve.metrics import ServiceMetrics
from puma.serve.requests import Limits, SearchRequest, image_view, parse_request
from puma.serve.versions import AliasFollower, Pinned

log = logging.getLogger(__name__)
api = FastAPI(title="PUMA search", docs_url=None, redoc_url=None, openapi_url=None)

# Serve pickles the ingress class when it is decorated, with the module globals its methods use
# as they are at that moment: helpers must be defined (or imported) above the deployment.


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
        self.page = resources.files("puma.serve").joinpath("page.html").read_text()
        self.metrics = ServiceMetrics(enabled=metrics)
        self.metrics.live(pinned.version, pinned.model_id)
        self.index.timer = self.metrics.stage  # the partitions' merge time
        self.versions = AliasFollower(pinned, location, model, self.index, storage_cfg, watch_interval_s,
                                      on_switch=self.metrics.live)

    def __del__(self) -> None:
        """Serve calls it when the replica shuts down: the metrics' last notes go to Ray."""
        metrics = getattr(self, "metrics", None)  # none when __init__ failed before it
        if metrics is not None:
            metrics.close()

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
            error = refusal(exc)
            if error is None:
                log.exception("internal error")
                error = internal_error(exc)
            if error.status == 503:
                self.metrics.refusal(error.cause)
            return error_response(error, self.limits.retry_after_s)
        return result if isinstance(result, Response) else JSONResponse(result)

    async def _health(self) -> dict:
        health = await self.index.health_async()
        return {"status": "ok", "items": health["items"], "auth": bool(self.token),
                "image_queries": self.model is not None, "version": self.versions.pinned.version,
                "model_id": self.versions.pinned.model_id}

    async def _stats(self, request: Request) -> dict:
        authorise(request, self.token, self.token_env)
        stats = {"index": await self.index.stats_async(), "auth": bool(self.token),
                 "version": self.versions.pinned.version, "model_id": self.versions.pinned.model_id,
                 "image_queries": self.model is not None, "limits": dataclasses.asdict(self.limits)}
        if self.model is not None:
            stats["model"] = await self.model.stats.remote()
        return stats

    async def _search(self, request: Request) -> dict:
        authorise(request, self.token, self.token_env)
        start = time.perf_counter()
        content_type = request.headers.get("content-type", "")
        body = await read_body(request, body_limit(content_type, self.limits.max_upload_bytes))
        query = parse_request(content_type, body, params(request), self.limits)
        request.state.kind = query.kind
        await fault_delay("serve.search")
        pinned = self.versions.pinned  # one version answers the whole request
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
        authorise(request, self.token, self.token_env)
        item_id = request.query_params.get("item_id", "")
        if not item_id:
            raise RequestError(400, "give the item: GET /image?item_id=<an indexed item id>")
        data = await self.index.thumbnail(item_id, self.versions.pinned.version)
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=3600"})
