"""The reference servers of bench/bench_serve.py: a plain FastAPI + uvicorn server over the same shards
(what a user would write by hand) and a no-op Ray Serve app (the engine's floor).

No `from __future__ import annotations` here: FastAPI reads the routes' annotations (Request) at run
time.
"""

import time

import numpy as np
from fastapi import FastAPI, Request

from puma.config import IndexConfig


def plain_server(index_uri: str, port: int, dim: int, k: int) -> None:
    """FastAPI + uvicorn in one process (run in a subprocess), answering POST /search {"vector", "k"}
    with the hits of the same shards (puma.serve.live_index.LiveIndex)."""
    import uvicorn

    from puma.serve.live_index import LiveIndex

    live = LiveIndex(IndexConfig(uri=index_uri, use_gpu=False, nprobe=16), None, dim)
    app = FastAPI()

    @app.post("/search")
    async def search(request: Request) -> dict:
        start = time.perf_counter()
        body = await request.json()
        hits = live.search_vector(np.asarray(body["vector"], np.float32), int(body.get("k", k)))
        return {"hits": hits, "took_ms": round(1000 * (time.perf_counter() - start), 2)}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


noop_api = FastAPI()


def deploy_noop(ingress: str, port: int):
    """A Ray Serve app in the service's ingress mode answering {"hits": []} under /noop. Where: port + 2
    (direct ingress: its own replica listens; port + 1 is Serve's head-node proxy), or the service's
    port (Serve's proxy routes by prefix)."""
    from ray import serve

    options = {"max_replicas_per_node": 1} if ingress == "direct" else {}

    @serve.deployment(name="noop", max_ongoing_requests=64, **options)
    @serve.ingress(noop_api)
    class Noop:
        @noop_api.post("/search")
        async def search(self, request: Request) -> dict:
            await request.body()
            return {"hits": [], "took_ms": 0.0}

    serve.run(Noop.bind(), name="noop", route_prefix="/noop")
    return (port + 2 if ingress == "direct" else port), "/noop"
