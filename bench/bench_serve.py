"""Search service vs brute-force numpy over the same vectors: p50 / p99 latency and queries/s at 1 and 8
concurrent clients, vector and image queries, side by side in one run (loopback only).

    python bench/bench_serve.py                          # 100k x 128 IVF index, ViT-S/14 at 112 px
    python bench/bench_serve.py --items 20000 --requests 60 --model tiny     # a quick run
    python bench/bench_serve.py --items 1000000 --model tiny --partitions 2   # + the fan-out's cost

Setup: --items synthetic clustered L2-normalised vectors (bench_index.clustered: a centre per 50
items) of the model's embedding size, written by puma.index as a sharded IVF-Flat index (trained
once, nprobe 16) recording the model id of a checkpoint built here (bench_embed.make_checkpoint:
the demo's offline backbone with fresh PUMA modules, or a tiny ViT), so image queries pass the
service's model check; vector queries lie near indexed vectors, image queries are CUB photos.
The service is ``puma.serve.run.start_service`` (what jobs/serve.py runs) on a local Ray bound to
127.0.0.1; clients are threads of this process with keep-alive HTTP connections.

Rows, each at 1 and at 8 concurrent clients, the variants interleaved round by round:

    service vector   POST /search {"vector": q, "k": 10}: HTTP, ingress, IVF over the shards, hits
    fastapi vector   the same request to a plain FastAPI + uvicorn server in one process holding the
                     same shards (puma.serve.live_index.LiveIndex): what a user would write by hand
    noop serve       the same request to a Ray Serve app (same ingress mode as the service) that
                     answers {"hits": []}: the engine's floor
    faiss vector     LiveIndex.search_vector in this process (FAISS over the shards + hits), no HTTP
    numpy vector     x @ q and a top-10 argpartition over the same vectors, in this process
    service image    POST /search with JPEG bytes: decode + eval view, batched forward, IVF, hits
    numpy image      decode + eval view + the same model's forward (one image) + brute force, in process

With --partitions N (N > 1), the same index also served in N partitions by a second app of the
same cluster (serve.index_partitions=N, vector queries only), one app per --partition-channels:

    service vector (N partitions)        the ingress fans out over the partitions' direct channels
    service vector (N partitions, ray)   the same through Ray Serve handles (serve.partition_channel=ray)

Their rows against "service vector" (one partition, the index inside the ingress) give the fan-out's
cost as a measured difference (p50 diff ms); "same hits" checks that the partitioned answers equal
the single service's for 100 queries (an exact merge).

    service vector (metrics on)          the one-partition service again, vector queries only
    service vector (metrics off)         the same app with serve.metrics=false: its queries/s over
                                         "metrics on"'s is the metrics' cost (issue 54: at most 5%);
                                         the two apps differ in nothing else (the full service also
                                         deploys the model, so it is not the baseline for this)

Each round runs the rows in the order above, and the next round in the reverse order, so that no row
always follows the same one (a row right after the in-process model's leaves its threads spinning).
--only restricts the rows to those whose names contain one of its comma-separated words.

ratio = service queries/s / numpy queries/s (above 1: the service answers more per second).
recall@10 = the service's IVF hits against the brute-force top 10. Bounded: --requests per row
(over all rounds) and --max-seconds per round of a row. Results: bench/results/serve.{json,md}
(serve_<words>.{json,md} for a run with --only <words>).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from bench_embed import make_checkpoint  # noqa: E402
from bench_index import clustered  # noqa: E402

from bench.record import record  # noqa: E402
from puma.config import IndexConfig, load_config  # noqa: E402
from puma.data.images import eval_view_spec, make_view  # noqa: E402
from puma.index import add_items, create_index  # noqa: E402

REPO = BENCH.parent
PHOTOS = REPO.parent / "shared" / "data" / "cub200-subset" / "CUB_200_2011" / "images"
K = 10
NOISE = 1.0  # per-dimension spread around the (standard normal) cluster centres: clustered, like embeddings


@dataclass
class Row:
    """One (variant, clients) measurement, summed over rounds."""

    variant: str
    clients: int
    latencies_ms: list[float] = field(default_factory=list)
    app_ms: list[float] = field(default_factory=list)  # service rows: time inside the app (took_ms)
    wall_s: float = 0.0
    errors: int = 0

    @property
    def qps(self) -> float:
        return len(self.latencies_ms) / self.wall_s if self.wall_s else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    def summary(self) -> dict:
        app = round(float(np.percentile(self.app_ms, 50)), 2) if self.app_ms else None
        return {"variant": self.variant, "clients": self.clients, "requests": len(self.latencies_ms),
                "errors": self.errors, "qps": round(self.qps, 2), "p50_ms": round(self.percentile(50), 2),
                "p99_ms": round(self.percentile(99), 2), "app_p50_ms": app}


# ----------------------------------------------------------------------------- setup


def build_index(uri: str, n: int, dim: int, model_id: str, seed: int) -> np.ndarray:
    """A sharded IVF-Flat index of n synthetic vectors with the embed job's columns; returns x (n, dim)."""
    rng = np.random.default_rng(seed)
    x = clustered(n, dim, rng.standard_normal((max(16, n // 50), dim), np.float32), rng, NOISE)
    cfg = IndexConfig(uri=uri, index_type="ivf_flat", nprobe=16, shard_size=50_000, use_gpu=True, seed=seed)
    create_index(uri, cfg, x, expected_items=n, model_id=model_id)
    table = pa.table({"item_id": [f"synthetic/{i:07d}" for i in range(n)],
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), dim),
                      "dataset": ["synthetic"] * n, "label": (np.arange(n) % 100).astype(np.int64),
                      "catalogue": ["bench://synthetic"] * n})
    add_items(uri, table, model_id=model_id)
    return x


def near(x: np.ndarray, n: int, seed: int) -> np.ndarray:
    """n queries close to (not equal to) random indexed vectors: (n, dim) float32, L2-normalised."""
    rng = np.random.default_rng(seed)
    q = x[rng.integers(0, len(x), n)] + 0.03 * rng.standard_normal((n, x.shape[1])).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def brute_force(x: np.ndarray, q: np.ndarray, k: int = K) -> np.ndarray:
    """Top-k rows of x by inner product with q (E,): the numpy baseline."""
    scores = x @ q  # (N,)
    top = np.argpartition(-scores, k)[:k]
    return top[np.argsort(-scores[top])]


def photos(n: int) -> list[bytes]:
    files = sorted(PHOTOS.glob("*/*.jpg"))[:n]
    if len(files) < n:
        raise SystemExit(f"found {len(files)} photos under {PHOTOS}; need {n}")
    return [f.read_bytes() for f in files]


# ----------------------------------------------------------------------------- clients


class Client:
    """One keep-alive HTTP connection to the service."""

    def __init__(self, port: int | tuple[int, str]) -> None:
        port, self.prefix = port if isinstance(port, tuple) else (port, "")
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def search(self, body: bytes, content_type: str, query: str = "") -> dict:
        """One POST /search; the parsed answer (raises on a status other than 200)."""
        self.conn.request("POST", f"{self.prefix}/search{query}", body=body,
                          headers={"Content-Type": content_type})
        response = self.conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {data[:300]!r}")
        return json.loads(data)


def run_clients(clients: int, requests: int, max_seconds: float, make_call) -> tuple[list, list, float, int]:
    """``clients`` threads share ``requests`` calls of ``make_call(thread)(i)``.

    Returns (latencies ms, the service's own took_ms where a call returns one, wall s, errors)."""
    latencies, app, errors, lock, next_i = [], [], [0], threading.Lock(), [0]
    deadline = time.perf_counter() + max_seconds

    def worker(t: int) -> None:
        call = make_call(t)
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= requests or time.perf_counter() > deadline:
                return
            start = time.perf_counter()
            try:
                answer = call(i)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors[0] += 1
                print(f"[bench] error: {exc}", flush=True)
                continue
            with lock:
                latencies.append(1000 * (time.perf_counter() - start))
                if isinstance(answer, dict):
                    app.append(answer["took_ms"])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, app, time.perf_counter() - start, errors[0]


# ----------------------------------------------------------------------------- the variants


def variants(ports: dict, x: np.ndarray, queries: np.ndarray, images: list[bytes], model, view,
             live) -> dict:
    """name -> make_call(thread) -> call(i) for every row (ports: service, fastapi, noop, and the
    partitioned services by row name)."""
    bodies = [json.dumps({"vector": q.tolist(), "k": K}).encode() for q in queries]
    port = ports["service"]

    def vector_to(where: str):
        def make(_t):
            client = Client(ports[where])
            return lambda i: client.search(bodies[i % len(bodies)], "application/json")
        return make

    def faiss_vector(_t):
        return lambda i: live.search_vector(queries[i % len(queries)], K) is None

    def numpy_vector(_t):
        return lambda i: brute_force(x, queries[i % len(queries)]) is None  # a bool: no took_ms

    def service_image(_t):
        client = Client(port)
        return lambda i: client.search(images[i % len(images)], "image/jpeg", f"?k={K}")

    def numpy_image(_t):
        def call(i):
            with torch.inference_mode():
                v = model(torch.from_numpy(make_view(images[i % len(images)], view)[None]))[0].numpy()  # (E,)
            brute_force(x, v)
        return call

    partitioned = {name: vector_to(name) for name in ports if name.startswith("service vector (")}
    return {"service vector": vector_to("service"), **partitioned, "fastapi vector": vector_to("fastapi"),
            "noop serve": vector_to("noop"), "faiss vector": faiss_vector, "numpy vector": numpy_vector,
            "service image": service_image, "numpy image": numpy_image}


def same_hits(one, other, queries: np.ndarray, n: int = 100) -> float:
    """Share of n vector queries that two services answer with the same item ids in the same order."""
    a, b, same = Client(one), Client(other), 0
    for q in queries[:n]:
        body = json.dumps({"vector": q.tolist(), "k": K}).encode()
        ids = [[h["item_id"] for h in c.search(body, "application/json")["hits"]] for c in (a, b)]
        same += ids[0] == ids[1]
    return same / n


def recall_at_k(port: int, x: np.ndarray, queries: np.ndarray, n: int = 100) -> float:
    """Mean |service top-k ∩ brute-force top-k| / k over n vector queries."""
    client, hits = Client(port), []
    for q in queries[:n]:
        answer = client.search(json.dumps({"vector": q.tolist(), "k": K}).encode(), "application/json")
        found = {int(h["item_id"].rsplit("/", 1)[1]) for h in answer["hits"]}
        hits.append(len(found & set(brute_force(x, q).tolist())) / K)
    return float(np.mean(hits))


# ----------------------------------------------------------------------------- reference servers


def start_plain_server(index_uri: str, dim: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--plain-server", index_uri, "--port", str(port),
                             "--dim", str(dim)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, port
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"the plain FastAPI server exited with {proc.returncode}") from None
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the plain FastAPI server did not start within 120 s")


def deploy_partitioned(overrides: list[str], partitions: int, channels: list[str], port: int,
                       ingress: str) -> dict[str, tuple[int, str]]:
    """The index in ``partitions`` partitions, one app per partition channel, beside the service (vector
    queries only): row name -> (port, route prefix). Direct ingress: their replicas take the ports after
    the no-op app's (port + 3, ...); proxy: Serve's proxy on ``port`` routes by prefix."""
    rows = {}
    for i, channel in enumerate(channels):
        row = f"service vector ({partitions} partitions{'' if channel == 'direct' else ', ' + channel})"
        settings = [f"serve.index_partitions={partitions}", f"serve.partition_channel={channel}"]
        at = port + 3 + i if ingress == "direct" else port
        rows[row] = deploy_vector_app(overrides, settings, f"p{partitions}-{channel}", at)
        print(f"[bench] {row}: at port {rows[row][0]}{rows[row][1]}", flush=True)
    return rows


def deploy_metrics_pair(overrides: list[str], port: int, ingress: str) -> dict[str, tuple[int, str]]:
    """The one-partition service twice more (vector queries only), with and without its metrics
    (serve.metrics), beside it: the second's row against the first's is what the metrics cost, the two
    apps being otherwise the same. Direct ingress: ``port`` and the next one."""
    rows = {}
    for i, on in enumerate(("on", "off")):
        row = f"service vector (metrics {on})"
        settings = ["serve.index_partitions=1", f"serve.metrics={'true' if on == 'on' else 'false'}"]
        at = port + i if ingress == "direct" else port
        rows[row] = deploy_vector_app(overrides, settings, f"metrics-{on}", at)
        print(f"[bench] {row}: at port {rows[row][0]}{rows[row][1]}", flush=True)
    return rows


def deploy_vector_app(overrides: list[str], settings: list[str], name: str, port: int) -> tuple[int, str]:
    """The service's config with ``settings`` as one more Serve app, vector queries only, named and
    routed ``name``, beside the service: (its port, its route prefix)."""
    from ray import serve

    from puma.serve.app import build_app
    from puma.serve.plan import plan_service

    cfg = load_config(None, [*overrides, *settings, "serve.image_queries=false", f"serve.app_name={name}"])
    serve.run(build_app(plan_service(cfg)), name=name, route_prefix=f"/{name}")
    return port, f"/{name}"


def only_words(args: argparse.Namespace) -> list[str]:
    """--only's words (none: every row)."""
    return [w for w in args.only.split(",") if w]


def metrics_record_us(n: int = 20000) -> dict[str, float]:
    """What one image query's metrics cost in a Ray worker, in microseconds: noting them on the query's
    path (the ingress notes five: the counter, the histogram, the exact time, the model's and the
    index's stage times; a vector or item query four), on and off (serve.metrics=false), and handing
    the notes to Ray's metrics in the replica's flushing thread, per query ("flush")."""
    import ray

    @ray.remote(num_cpus=0)
    def measure() -> dict[str, float]:
        from puma.serve.metrics import ServiceMetrics

        out = {}
        for label, enabled in (("on", True), ("off", False)):
            metrics, start = ServiceMetrics(enabled=enabled, flush_interval_s=3600), time.perf_counter()
            for _ in range(n):
                metrics.stage("model", 0.0015)
                metrics.stage("index", 0.0005)
                metrics.request("/search", "image", 200, 0.0025)
            out[label] = round(1e6 * (time.perf_counter() - start) / n, 2)
            if enabled:
                start = time.perf_counter()
                metrics.flush()
                out["flush"] = round(1e6 * (time.perf_counter() - start) / n, 2)
                metrics.close()
        return out

    return ray.get(measure.remote())


# ----------------------------------------------------------------------------- reporting


def setting(args: argparse.Namespace) -> dict:
    """What this run measured, and how loaded the machine was before it (bench.record adds the rest)."""
    return {"args": vars(args), "load_average_start": round(os.getloadavg()[0], 2)}


def ratios(rows: dict[tuple[str, int], Row]) -> list[dict]:
    """The service against each reference row of the same query kind and clients; each partitioned
    service against the one-partition service (the fan-out's cost: p50_diff_ms)."""
    pairs = [("vector", "service vector", ref) for ref in
             ("numpy vector", "faiss vector", "fastapi vector", "noop serve")]
    pairs += [("image", "service image", "numpy image")]
    pairs += [(name.removeprefix("service "), name, "service vector")
              for name in dict.fromkeys(n for n, _ in rows) if name.startswith("service vector (")]
    pairs += [("vector (metrics off)", "service vector (metrics off)", "service vector (metrics on)")]
    out = []
    for kind, name, reference in pairs:
        for clients in sorted({c for _, c in rows}):
            service, other = rows.get((name, clients)), rows.get((reference, clients))
            if service and other and other.qps:
                out.append({"query": kind, "against": reference, "clients": clients,
                            "qps_ratio": round(service.qps / other.qps, 3),
                            "p50_ratio": round(service.percentile(50) / other.percentile(50), 3),
                            "p50_diff_ms": round(service.percentile(50) - other.percentile(50), 2)})
    return out


def markdown(env: dict, rows: list[dict], ratio_rows: list[dict], recall: float) -> str:
    lines = [f"Load average {env['load_average_start']} at the start, {env['load_average_end']} at the end "
             "(the machine is shared: compare rows of this run only).", "",
             f"Index: {env['args']['items']} x {env['dim']} synthetic vectors, IVF-Flat (nlist "
             f"{env['nlist']}, nprobe 16), {env['shards']} shards; model {env['model']}; k = {K}; service "
             f"recall@{K} vs brute force: {recall:.3f}; serve.ingress={env['args']['ingress']}"
             + (f"; the other services (partitions: {env['args']['partitions']}, metrics on and off) give "
                f"the same hits as it for {100 * env['same_hits']:.0f}% of 100 queries"
                if "same_hits" in env else ""), "",
             "| row | clients | requests | queries/s | p50 ms | p99 ms | p50 ms inside the app |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['clients']} | {r['requests']} | {r['qps']:.1f} | {r['p50_ms']:.1f} | "
              f"{r['p99_ms']:.1f} | {'' if r['app_p50_ms'] is None else format(r['app_p50_ms'], '.1f')} |"
              for r in rows]
    if "metrics_record_us" in env:
        cost = env["metrics_record_us"]
        service = next((r for r in rows if r["variant"] == "service vector" and r["clients"] == 1), None)
        share = f" ({100 * cost['on'] / 1000 / service['p50_ms']:.3f}% of the service's p50 at 1 client)" \
            if service else ""
        lines += ["", f"One image query's metrics in a Ray worker: noted on its path in {cost['on']:.2f} us "
                      f"({cost['off']:.2f} us with serve.metrics=false){share}; handed to Ray's metrics by "
                      f"the replica's flushing thread in {cost.get('flush', float('nan')):.1f} us a query."]
    lines += ["", "| service query | against | clients | queries/s ratio | p50 ratio | p50 diff ms |",
              "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['query']} | {r['against']} | {r['clients']} | {r['qps_ratio']:.2f} | "
              f"{r['p50_ratio']:.2f} | {r['p50_diff_ms']:+.2f} |" for r in ratio_rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=100_000, help="indexed synthetic vectors (default 100k)")
    p.add_argument("--model", choices=("vit_s", "tiny"), default="vit_s",
                   help="image model: the demo's offline ViT-S/14 (128-d) or a tiny ViT")
    p.add_argument("--img-size", type=int, default=112, help="ViT-S input size (the demo's 112)")
    p.add_argument("--clients", default="1,8", help="comma-separated concurrent clients")
    p.add_argument("--requests", type=int, default=240, help="requests per row, over all rounds")
    p.add_argument("--rounds", type=int, default=3, help="rounds; every row runs once per round, interleaved")
    p.add_argument("--max-seconds", type=float, default=60.0, help="time limit of one row in one round")
    p.add_argument("--model-cpus", type=float, default=2.0, help="torch threads of the model, both sides")
    p.add_argument("--port", type=int, default=0, help="service port (0: a free one)")
    p.add_argument("--no-save", action="store_true", help="do not write bench/results/serve.{json,md}")
    p.add_argument("--ingress", choices=("direct", "proxy"), default="direct", help="serve.ingress")
    p.add_argument("--partitions", type=int, default=0,
                   help="also serve the index in N > 1 partitions (one more app per partition channel) and "
                        "measure its vector rows beside the one-partition service")
    p.add_argument("--partition-channels", default="direct",
                   help="serve.partition_channel values (direct, ray), comma-separated: an app each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="run only the rows whose names contain one of these "
                   "comma-separated words (e.g. 'metrics' for the metrics' cost alone)")
    p.add_argument("--plain-server", metavar="INDEX_URI", help=argparse.SUPPRESS)  # the FastAPI row's server
    p.add_argument("--dim", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build the index, start the service, run the rows interleaved, print and record the ratios."""
    args = parse_args(argv)
    if args.plain_server:
        from serve_references import plain_server

        plain_server(args.plain_server, args.port, args.dim, K)
        return 0
    env = setting(args)  # the machine's load before this run adds to it
    clients = [int(c) for c in args.clients.split(",")]
    port = args.port or free_port()
    own_ray_tmp = "PUMA_RAY_TMP" not in os.environ
    os.environ.setdefault("PUMA_RAY_TMP", tempfile.mkdtemp(prefix="rayb", dir="/tmp"))  # short: socket paths
    os.environ.pop("PUMA_SERVE_TOKEN", None)
    from puma.checkpoint import checkpoint_id
    from puma.index import read_manifest
    from puma.runtime import init_ray
    from puma.serve.live_index import LiveIndex
    from puma.serve.run import direct_ingress_env, start_service, stop_service

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        ckpt, model, model_cfg = make_checkpoint(args.model, args.img_size, str(Path(tmp) / "ckpt"))
        dim = model_cfg.model.head.embed_dim
        start = time.perf_counter()
        x = build_index(str(Path(tmp) / "index"), args.items, dim, checkpoint_id(ckpt), args.seed)
        manifest = read_manifest(str(Path(tmp) / "index"))
        print(f"[bench] index: {args.items} x {dim}, {manifest.factory}, {len(manifest.shards)} shards "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        queries = near(x, 256, args.seed + 1)
        images = photos(32)
        torch.set_num_threads(max(1, int(args.model_cpus)))
        model.eval()
        overrides = [
            f"index.uri={Path(tmp) / 'index'}", f"embed.checkpoint={ckpt}", f"serve.port={port}",
            "serve.model_min_replicas=1", "serve.model_max_replicas=1", "serve.index_min_replicas=1",
            "serve.index_max_replicas=1", f"serve.model_num_cpus={args.model_cpus}",
            "serve.index_num_cpus=0.5", "serve.ingress_num_cpus=0.5", "serve.watch_interval_s=60",
            "index.nprobe=16", f"serve.max_k={K}", f"serve.ingress={args.ingress}"]
        cfg = load_config(None, [*overrides, "serve.index_partitions=1"])
        channels = [c for c in args.partition_channels.split(",") if c] if args.partitions > 1 else []
        # the service's ingress mode, with room for the no-op app's own ingress replica (port + 2: Serve's
        # head-node proxy has port + 1) and the partitioned apps' (port + 3, ...)
        # and the two metrics apps' (after those)
        os.environ.update(direct_ingress_env(cfg.serve) | (
            {"RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 5 + len(channels))}
            if args.ingress == "direct" else {}))
        init_ray(local_cpus=8 if channels else 6)  # logical CPUs: room for every app's replicas
        service = start_service(cfg)
        plain, plain_port = start_plain_server(str(Path(tmp) / "index"), dim)
        try:
            print(f"[bench] service at {service.url} on {service.ray}", flush=True)
            from serve_references import deploy_noop

            ports = {"service": port, "fastapi": plain_port, "noop": deploy_noop(args.ingress, port)}
            ports |= deploy_partitioned(overrides, args.partitions, channels, port, args.ingress)
            bare_port = port + 3 + len(channels) if args.ingress == "direct" else port
            ports |= deploy_metrics_pair(overrides, bare_port, args.ingress)
            live = LiveIndex(IndexConfig(uri=str(Path(tmp) / "index"), use_gpu=False, nprobe=16), None, dim)
            calls = variants(ports, x, queries, images, model, eval_view_spec(model_cfg), live)
            words = only_words(args)
            calls = {n: c for n, c in calls.items() if not words or any(w in n for w in words)}
            rows = measure(args, clients, calls)
            recall = recall_at_k(port, x, queries)
            env["metrics_record_us"] = metrics_record_us()
            for name in ports:
                if name.startswith("service vector ("):
                    env["same_hits"] = min(env.get("same_hits", 1.0), same_hits(port, ports[name], queries))
        finally:
            plain.kill()
            stop_service(service)
            if own_ray_tmp:
                shutil.rmtree(os.environ.pop("PUMA_RAY_TMP"), ignore_errors=True)
    backbone = model_cfg.model.backbone
    env |= {"dim": dim, "nlist": manifest.nlist, "shards": len(manifest.shards),
            "model": f"{backbone.name} at {backbone.img_size} px",
            "load_average_end": round(os.getloadavg()[0], 2)}
    return report(env, rows, recall, args)


def measure(args: argparse.Namespace, clients: list[int], calls: dict) -> dict[tuple[str, int], Row]:
    """Every (variant, clients) row, --rounds times, interleaved; one warm-up call each first."""
    rows = {(name, c): Row(name, c) for c in clients for name in calls}
    for make_call in calls.values():
        make_call(0)(0)  # warm-up: connections, lazy imports, first batch
    per_round = max(1, args.requests // args.rounds)
    for r in range(args.rounds):
        order = list(calls.items()) if r % 2 == 0 else list(reversed(calls.items()))
        for c in clients:
            for name, make_call in order:
                latencies, app, wall, errors = run_clients(c, per_round, args.max_seconds, make_call)
                row = rows[(name, c)]
                row.latencies_ms += latencies
                row.app_ms += app
                row.wall_s += wall
                row.errors += errors
                p50 = np.percentile(latencies, 50) if latencies else float("nan")
                print(f"[bench] round {r + 1}/{args.rounds} {name:<15} x{c}: "
                      f"{len(latencies) / wall:8.1f} q/s, p50 {p50:7.1f} ms", flush=True)
    return rows


def report(env: dict, rows: dict[tuple[str, int], Row], recall: float, args: argparse.Namespace) -> int:
    """Print the table and ratios; write bench/results/serve.{json,md}; 1 if any request failed."""
    summaries = [row.summary() for row in rows.values()]
    ratio_rows = ratios(rows)
    text = markdown(env, summaries, ratio_rows, recall)
    print(text)
    if not args.no_save:
        payload = {"setting": env, "rows": summaries, "ratios": ratio_rows, "recall_at_k": recall}
        record("_".join(["serve", *only_words(args)]), payload, text,  # some rows only: their own record
               title="bench_serve: search service vs reference servers, FAISS and numpy")
    return 1 if any(r.errors for r in rows.values()) else 0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
