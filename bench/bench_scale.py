"""The catalogue loop and the search service at production size: a table catalogue of N rows over real
photos, embedded, reconciled and served by the real jobs; every figure of one run recorded together.

    python bench/bench_scale.py --n 1000000                   # the real jobs end to end (about 25 min here)
    python bench/bench_scale.py --n 10000000 --seed-index     # 10M rows: the first embed through the
                                                              # index's commit path (below); the rest real
    python bench/bench_scale.py --n 20000 --requests 200      # a quick run of every step

The catalogue: ``items.csv`` with item_id (``sku-00000042``), image_uri (an absolute path), category,
brand, price and in_stock (metadata the index stores and every hit shows). Every row has its own image
path. Photo files: --photos distinct JPEGs (default min(N, 1M)), copies of the 6,862 sample photos in
../shared/data (12 flower species, 100 CUB species) each with a JPEG comment naming it, so its bytes
and sha256 are its own while its pixels are the source photo's; past that, rows get hard links to those
files (distinct paths, shared bytes), as a catalogue whose photos sit in many folders. The model is the
tests' tiny PUMA checkpoint (16-d embeddings).

Steps, each a real job in its own process (the driver's peak memory is that process's max RSS; Ray's
workers are other processes). A job is started through a small launcher process (``PEAK_LAUNCHER``):
a process forked straight from this bench, which holds the N-row table, would report the bench's own
peak, since Linux carries a forked process's high-water mark across its exec.

    first embed   jobs/embed.py on the new table: list, stamp, read, decode, embed, commit every row.
                  With --seed-index the rows are committed instead through the index's own commit path
                  (puma.index create_index / commit_changes, then promote) with the job's own listing
                  (puma.inference.catalogue.list_catalogue: stamps and metadata as the job stores them)
                  and the model's embeddings of the sample photos (each row gets its source photo's
                  embedding and its file's sha256): what the job would write, without embedding N
                  images on 2 cores.
    no-op         jobs/embed.py again, nothing changed: listing, stamps and planning only.
    1% change     --change of the rows changed: half moved to new photos (new files), a quarter
                  removed, a quarter added (new ids, new files); the table rewritten in place.
    service       jobs/serve.py on that index (image queries off), 1 and then 2 partitions: seconds to
                  ready (start to /healthz answering with every item), memory of every Serve replica
                  (RSS, anonymous and file-backed; /proc), the jobs/serve.py process, p50/p99 of vector
                  and item-id queries from 1 and 8 clients.
    served after  a second 1% change embedded while the 1-partition service runs: seconds from the job's
                  start until the service answers from it (a removed item 404, an added one found).

--reuse-index takes the index an earlier run left in the scratch folder (--keep, or a seeded one) as
the first embed, and measures every later step.

Results: bench/results/bench_scale_<N>.{json,md} (the scratch folder is kept for reruns: --keep).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))
sys.path.append(str(REPO / "tests"))  # tiny.py

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.csv as pacsv  # noqa: E402

from bench.record import record  # noqa: E402

PYTHON = sys.executable
DATA = REPO.parent / "shared" / "data"
PHOTO_GLOBS = ("flowers12-subset/*/*.jpg", "cub200-subset/CUB_200_2011/images/*/*.jpg")
PER_FOLDER = 1000
CATEGORIES = ("boots", "sandals", "sneakers", "heels", "loafers", "slippers", "clogs", "flats", "mules",
              "oxfords", "wedges", "espadrilles", "moccasins", "pumps", "derbies", "brogues")
BRANDS = tuple(f"brand{i:03d}" for i in range(200))
K = 10
TARGETS = {"noop_1m_s": 30, "change_ratio_1m": 0.05, "plan_1m_s": 30, "noop_10m_s": 300,
           "driver_peak_10m_gb": 4.0, "ready_10m_s": 120, "ingress_bytes_per_item": 200, "p50_10m_ms": 5.0,
           "qps8_10m": 300, "p50_2part_1m_ms": 4.0, "qps8_2part_1m": 300}


# ----------------------------------------------------------------------------- photos and the table


def source_photos() -> list[Path]:
    """The sample photos, flowers then CUB, sorted."""
    photos = [p for pattern in PHOTO_GLOBS for p in sorted(DATA.glob(pattern))]
    if not photos:
        raise SystemExit(f"no sample photos under {DATA} ({', '.join(PHOTO_GLOBS)})")
    return photos


def tagged_jpeg(data: bytes, tag: str) -> bytes:
    """The JPEG with a comment (COM) segment holding ``tag`` after SOI: its own bytes, the same pixels."""
    text = tag.encode()
    return data[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + data[2:]


def photo_path(root: Path, i: int) -> Path:
    return root / f"d{i // PER_FOLDER:05d}" / f"p{i:08d}.jpg"


def make_photos(root: Path, count: int, sources: list[Path], tag: str = "photo") -> None:
    """``count`` distinct files under ``root`` (reused when a previous run made at least as many)."""
    marker = root / "count.txt"
    if marker.exists() and int(marker.read_text()) >= count:
        return
    data = [p.read_bytes() for p in sources]
    start = time.monotonic()
    for i in range(count):
        path = photo_path(root, i)
        if i % PER_FOLDER == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(tagged_jpeg(data[i % len(data)], f"bench_scale {tag} {i}"))
    marker.write_text(str(count))
    print(f"[bench] {count} photos under {root} in {time.monotonic() - start:.0f} s", flush=True)


def row_paths(ws: Workspace, rows: np.ndarray) -> list[str]:
    """Each row's image path: its own photo file, or past --photos a hard link to photo row % photos."""
    return [str(photo_path(ws.photos, int(r)) if r < ws.photo_count else photo_path(ws.links, int(r)))
            for r in rows]


def make_links(ws: Workspace, n: int) -> None:
    """Hard links for rows past the photo files (reused when present)."""
    marker = ws.links / "count.txt"
    if ws.photo_count >= n or (marker.exists() and int(marker.read_text()) >= n):
        return
    start = time.monotonic()
    for r in range(ws.photo_count, n):
        path = photo_path(ws.links, r)
        if r % PER_FOLDER == 0 or r == ws.photo_count:
            path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.link(photo_path(ws.photos, r % ws.photo_count), path)
    marker.write_text(str(n))
    print(f"[bench] {n - ws.photo_count} hard links in {time.monotonic() - start:.0f} s", flush=True)


def table_rows(rows: np.ndarray, paths: list[str], seed: int) -> pa.Table:
    """The catalogue's columns for row numbers ``rows`` with image paths ``paths``."""
    rng = np.random.default_rng(seed)
    n = len(rows)
    return pa.table({
        "item_id": pa.array([f"sku-{r:08d}" for r in rows.tolist()], pa.string()),
        "image_uri": pa.array(paths, pa.string()),
        "category": pa.array(np.array(CATEGORIES)[rows % len(CATEGORIES)]),
        "brand": pa.array(np.array(BRANDS)[(rows * 7) % len(BRANDS)]),
        "price": pa.array(np.round(rng.uniform(5, 300, n), 2)),
        "in_stock": pa.array(rng.random(n) < 0.8)})


def write_table(path: Path, table: pa.Table) -> None:
    tmp = path.with_suffix(".tmp")
    pacsv.write_csv(table, tmp)
    os.replace(tmp, path)


def make_table(ws: Workspace, n: int) -> pa.Table:
    rows = np.arange(n, dtype=np.int64)
    table = table_rows(rows, row_paths(ws, rows), seed=0)
    write_table(ws.table, table)
    return table


@dataclass
class Change:
    """A 1% change: rows moved to new photos, removed, added (item ids)."""

    moved: list[str]
    removed: list[str]
    added: list[str]


def change_table(ws: Workspace, table: pa.Table, fraction: float, seed: int, sources: list[Path]) -> tuple[
        pa.Table, Change]:
    """Change ``fraction`` of the rows (half moved to new photo files, a quarter removed, a quarter added
    under new ids with new files) and rewrite the table in place."""
    n = len(table)
    k = max(4, round(n * fraction))
    gone = k // 4
    rng = np.random.default_rng(seed)
    chosen = rng.choice(n, size=k - gone, replace=False)
    moved, removed = np.sort(chosen[:k - 2 * gone]), np.sort(chosen[k - 2 * gone:])
    first_new = int(pc.max(pc.cast(pc.utf8_slice_codeunits(table["item_id"], 4), pa.int64())).as_py()) + 1
    added_rows = np.arange(first_new, first_new + gone, dtype=np.int64)
    new_dir = ws.root / f"new_photos_{seed}"
    data = [p.read_bytes() for p in sources]
    new_paths = []
    for j in range(len(moved) + gone):
        path = photo_path(new_dir, j)
        if j % PER_FOLDER == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(tagged_jpeg(data[(j * 7 + seed) % len(data)], f"bench_scale change {seed} {j}"))
        new_paths.append(str(path))
    image = np.array(table["image_uri"].to_pylist(), dtype=object)
    image[moved] = new_paths[:len(moved)]
    keep = np.ones(n, dtype=bool)
    keep[removed] = False
    changed = table.set_column(1, "image_uri", pa.array(image.tolist(), pa.string())).filter(pa.array(keep))
    added = table_rows(added_rows, new_paths[len(moved):], seed=seed + 1)
    changed = pa.concat_tables([changed, added.cast(changed.schema)])
    write_table(ws.table, changed)
    ids = table["item_id"]
    return changed, Change(ids.take(pa.array(moved)).to_pylist(), ids.take(pa.array(removed)).to_pylist(),
                           added["item_id"].to_pylist())


# ----------------------------------------------------------------------------- the jobs


@dataclass
class Workspace:
    root: Path
    photos: Path
    photo_count: int
    links: Path = field(init=False)
    table: Path = field(init=False)
    index: Path = field(init=False)
    checkpoint: Path = field(init=False)

    def __post_init__(self) -> None:
        self.links, self.table = self.root / "links", self.root / "catalogue" / "items.csv"
        self.index, self.checkpoint = self.root / "index", self.root / "checkpoint"
        self.table.parent.mkdir(parents=True, exist_ok=True)


def job_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return dict(env, PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")


PEAK_LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""  # forks the job from a small process: its max RSS is its own (module docstring)


def run_job(argv: list[str], log: Path) -> dict:
    """Run a job to the end in its own process: wall seconds, its max RSS (bytes), its output."""
    start = time.monotonic()
    peak = log.with_suffix(".peak")
    with open(log, "w") as out:
        proc = subprocess.run([PYTHON, "-c", PEAK_LAUNCHER, str(peak), PYTHON, *argv], cwd=REPO,
                              env=job_env(), stdout=out, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    text = log.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed; its output ({log}):\n{text[-4000:]}")
    return {"seconds": round(seconds, 1), "peak_rss_bytes": int(peak.read_text()),
            "report": parse_report(text)}


REPORT = re.compile(r"embedded (?P<embedded>\d+), already indexed (?P<indexed>\d+); added (?P<added>\d+), "
                    r"changed (?P<changed>\d+), removed (?P<removed>\d+), restamped (?P<restamped>\d+); "
                    r"rejected (?P<rejected>\d+).*index total (?P<total>\d+)")
PLANNED = re.compile(r"planned in (?P<plan>[\d.]+) s")


def parse_report(text: str) -> dict:
    """The counts of the job's summary line (and its planning seconds when it prints them)."""
    found = REPORT.search(text)
    if found is None:
        raise SystemExit(f"no report line in the job's output:\n{text[-3000:]}")
    out = {k: int(v) for k, v in found.groupdict().items()}
    planned = PLANNED.search(text)
    if planned is not None:
        out["plan_seconds"] = float(planned.group("plan"))
    return out


def embed_argv(ws: Workspace, extra: list[str]) -> list[str]:
    return ["jobs/embed.py", "--catalogue", str(ws.table), f"index.uri={ws.index}",
            f"embed.checkpoint={ws.checkpoint}", *extra]


def check_counts(name: str, report: dict, expected: dict) -> None:
    wrong = {k: (report.get(k), v) for k, v in expected.items() if report.get(k) != v}
    if wrong:
        raise SystemExit(f"{name}: the job's counts differ from the change made (got, expected): {wrong}")


# ----------------------------------------------------------------------------- seeding 10M rows


def seed_index(ws: Workspace, n: int, sources: list[Path]) -> dict:
    """The first embed's result, committed through the index's own path (module docstring)."""
    from puma import storage
    from puma.checkpoint import checkpoint_id, read_checkpoint
    from puma.config import IndexConfig
    from puma.index import create_index
    from puma.index.build import commit_changes
    from puma.index.manifest import Manifest, now
    from puma.index.plan import plan_index
    from puma.index.table import EMBEDDING, FINGERPRINT, IMAGE_URI, ITEM_ID
    from puma.index.versions import promote, version_name, version_uri
    from puma.inference.catalogue import catalogue_name, list_catalogue, plain
    from puma.inference.embedder import OUTPUT_COLUMNS, fingerprint

    start = time.monotonic()
    emb = source_embeddings(ws, sources)  # (S, E)
    listing = list_catalogue(str(ws.table))
    refs = listing.refs
    table_ids = pacsv.read_csv(ws.table, convert_options=pacsv.ConvertOptions(
        include_columns=["item_id"], column_types={"item_id": pa.string()}))["item_id"]
    row = pc.index_in(refs[ITEM_ID], value_set=table_ids).to_numpy()  # each ref's row in the table
    photo = row % ws.photo_count  # (N,)
    prints = np.array([fingerprint(photo_path(ws.photos, i).read_bytes()) for i in range(ws.photo_count)],
                      dtype=object)
    state = read_checkpoint(str(ws.checkpoint))
    model_id = checkpoint_id(str(ws.checkpoint), state)
    location, catalogue = str(ws.index), storage.absolute(str(ws.table))
    version = version_name(model_id)
    uri = version_uri(location, version)
    cfg = IndexConfig(uri=location)
    plan = plan_index(cfg, n, emb.shape[1])
    sample = emb[photo[np.random.default_rng(0).choice(n, size=min(n, plan.train_sample), replace=False)]
                 % len(sources)]
    create_index(uri, cfg, sample, expected_items=n, model_id=model_id, checkpoint=str(ws.checkpoint))
    for lo in range(0, len(refs), cfg.shard_size):
        part = plain(refs.slice(lo, cfg.shard_size))  # the listing's dictionary columns as plain strings
        p = photo[lo:lo + cfg.shard_size]
        x = emb[p % len(sources)]
        block = part.set_column(part.schema.get_field_index(FINGERPRINT), FINGERPRINT,
                                pa.array(prints[p].tolist(), pa.string()))
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), x.shape[1])
        block = block.append_column(EMBEDDING, vectors)
        commit_changes(uri, block.select(list(OUTPUT_COLUMNS)), source=catalogue)
        print(f"[bench] seeded {lo + len(part)} of {len(refs)} rows", flush=True)

    def update(m: Manifest) -> None:
        m.catalogues[catalogue] = {"name": catalogue_name(catalogue), "items": len(refs), "updated": now()}

    commit_changes(uri, None, source=catalogue, update=update)
    promote(location, version)
    assert IMAGE_URI in refs.column_names
    return {"seconds": round(time.monotonic() - start, 1), "report": {"added": len(refs), "total": len(refs)},
            "how": "seeded through puma.index commit_changes (module docstring)"}


def source_embeddings(ws: Workspace, sources: list[Path]) -> np.ndarray:
    """The model's embeddings of the sample photos (S, E), in this process (eval view, no Ray)."""
    from puma import storage
    from puma.checkpoint import read_checkpoint
    from puma.data.images import eval_view_spec, make_view
    from puma.inference.embedder import Embedder

    view = eval_view_spec(read_checkpoint(str(ws.checkpoint)).config)
    model = Embedder(str(ws.checkpoint), "", storage.current_config(), use_gpu=False, threads=0)
    out = [model.forward(np.stack([make_view(p.read_bytes(), view) for p in sources[lo:lo + 256]]))
           for lo in range(0, len(sources), 256)]
    return np.concatenate(out)  # (S, E)


# ----------------------------------------------------------------------------- the service


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """jobs/serve.py in its own process group, on a free port pair."""

    def __init__(self, ws: Workspace, partitions: int, log: Path) -> None:
        self.port = free_port()
        while True:  # direct ingress takes port and port + 1
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", self.port + 1))
                break
            except OSError:
                self.port = free_port()
        argv = [PYTHON, "jobs/serve.py", f"index.uri={ws.index}", "serve.image_queries=false",
                f"serve.port={self.port}", "serve.host=127.0.0.1", f"serve.index_partitions={partitions}",
                "serve.watch_interval_s=2", f"embed.checkpoint={ws.checkpoint}"]
        self.log = log
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=REPO, env=job_env(), stdout=open(log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, items: int, timeout: float = 1800) -> float:
        """Seconds from the start until /healthz answers with ``items`` items."""
        while time.monotonic() - self.started < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"jobs/serve.py exited:\n{self.log.read_text()[-4000:]}")
            try:
                status, body = get(self.port, "/healthz")
                if status == 200 and body.get("items") == items:
                    return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"the service was not ready in {timeout:.0f} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def get(port: int, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def memory(pattern: str) -> list[dict]:
    """RSS, anonymous and file-backed resident bytes of every process whose command line matches."""
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    found = []
    for pid in out:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
        except OSError:
            continue
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in status.splitlines())
              if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
        found.append({"pid": int(pid), "process": name, **{k: v * 1024 for k, v in kb.items()}})
    return found


def query_latencies(port: int, bodies: list[bytes], clients: int) -> dict:
    """p50 / p99 ms and queries/s of POST /search for ``bodies`` shared by ``clients`` threads."""
    latencies, errors, lock, cursor = [], [], threading.Lock(), [0]

    def worker() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while True:
            with lock:
                i = cursor[0]
                cursor[0] += 1
            if i >= len(bodies):
                return
            t = time.perf_counter()
            conn.request("POST", "/search", body=bodies[i], headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            ms = 1000 * (time.perf_counter() - t)
            with lock:
                (latencies if response.status == 200 else errors).append(ms if response.status == 200
                                                                          else data[:200])

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"{len(errors)} queries failed, e.g. {errors[:3]}")
    lat = np.sort(np.array(latencies))
    return {"p50_ms": round(float(np.percentile(lat, 50)), 2),
            "p99_ms": round(float(np.percentile(lat, 99)), 2), "qps": round(len(lat) / wall, 1),
            "requests": len(lat)}


def query_bodies(ws: Workspace, table: pa.Table, count: int, seed: int) -> dict[str, list[bytes]]:
    """Vector queries near indexed embeddings (sample photos' embeddings, jittered) and item-id queries."""
    rng = np.random.default_rng(seed)
    emb = np.load(ws.root / "source_embeddings.npy")
    q = emb[rng.integers(0, len(emb), count)] + 0.02 * rng.standard_normal((count, emb.shape[1]))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    ids = table["item_id"].take(pa.array(rng.integers(0, len(table), count))).to_pylist()
    return {"vector": [json.dumps({"vector": v.tolist(), "k": K}).encode() for v in q.astype(np.float32)],
            "item_id": [json.dumps({"item_id": i, "k": K}).encode() for i in ids]}


def measure_service(ws: Workspace, partitions: int, table: pa.Table, args: argparse.Namespace) -> dict:
    """Start, wait until ready, measure memory and queries, stop."""
    service = Service(ws, partitions, ws.root / f"serve_{partitions}.log")
    try:
        ready = service.wait_ready(len(table))
        time.sleep(3)  # the watcher's first tick and the replicas settle
        bodies = query_bodies(ws, table, args.requests, seed=partitions)
        out = {"partitions": partitions, "ready_s": round(ready, 1)}
        for kind, queries in bodies.items():
            query_latencies(service.port, queries[:min(50, len(queries))], 1)  # warm
            for clients in (1, 8):
                out[f"{kind}_{clients}"] = query_latencies(service.port, queries, clients)
        out["replicas"] = memory("ray::ServeReplica")
        out["serve_process"] = memory(f"jobs/serve.py index.uri={ws.index}")
        return out
    finally:
        service.stop()


def served_after_change(ws: Workspace, table: pa.Table, args: argparse.Namespace,
                        sources: list[Path]) -> tuple[pa.Table, dict]:
    """A 1% change embedded while a 1-partition service runs: seconds until the service answers from it."""
    service = Service(ws, 1, ws.root / "serve_change.log")
    try:
        service.wait_ready(len(table))
        table, change = change_table(ws, table, args.change, seed=2, sources=sources)
        start = time.monotonic()
        job = subprocess.Popen([PYTHON, *embed_argv(ws, args.set)], cwd=REPO, env=job_env(),
                               stdout=open(ws.root / "change_served.log", "w"), stderr=subprocess.STDOUT)
        removed, added = change.removed[0], change.added[0]
        served = None
        while served is None and time.monotonic() - start < 3600:
            gone = post(service.port, {"item_id": removed, "k": 1})[0] == 404
            new = post(service.port, {"item_id": added, "k": 1})[0] == 200
            if gone and new:
                served = time.monotonic() - start
            time.sleep(0.25)
        job_rc = job.wait()
        job_s = time.monotonic() - start
        if job_rc != 0 or served is None:
            raise SystemExit(f"the change was not served (job exit {job_rc})")
        return table, {"served_s": round(served, 1), "job_s": round(job_s, 1), "rows": len(change.moved)
                       + len(change.removed) + len(change.added)}
    finally:
        service.stop()


def post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/search", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


# ----------------------------------------------------------------------------- the run


def faiss_bytes(ws: Workspace) -> int:
    from puma.index.versions import live_manifest

    manifest = live_manifest(str(ws.index))
    return manifest.trained.bytes + sum(s.index.bytes for s in manifest.shards)


def run(args: argparse.Namespace) -> dict:
    sources = source_photos()
    root = Path(args.scratch or f"/tmp/puma-scale-{args.n}")
    ws = Workspace(root, Path(args.photos_dir), min(args.n, args.photos))
    make_photos(ws.photos, ws.photo_count, sources)
    make_links(ws, args.n)
    if ws.index.exists() and not args.reuse_index:
        shutil.rmtree(ws.index)
    from tiny import make_checkpoint

    if not (ws.checkpoint / "config.yaml").exists():
        make_checkpoint(str(ws.checkpoint))
    np.save(ws.root / "source_embeddings.npy", source_embeddings(ws, sources))
    table = make_table(ws, args.n)
    out: dict = {"n": args.n, "photo_files": ws.photo_count, "seeded": args.seed_index or args.reuse_index}
    if args.reuse_index:
        if not ws.index.exists():
            raise SystemExit(f"--reuse-index: no index at {ws.index}; run with --keep or --seed-index first")
        out["first"] = {"seconds": "-", "report": {},
                        "how": "the index an earlier run of this bench left (--reuse-index)"}
    elif args.seed_index:
        out["first"] = seed_index(ws, args.n, sources)
    else:
        out["first"] = run_job(embed_argv(ws, args.set), root / "first.log")
        check_counts("first embed", out["first"]["report"], {"added": args.n, "total": args.n})
    print(f"[bench] first embed: {out['first']['seconds']} s", flush=True)
    out["noop"] = run_job(embed_argv(ws, args.set), root / "noop.log")
    check_counts("no-op", out["noop"]["report"], {"embedded": 0, "removed": 0, "total": args.n})
    print(f"[bench] no-op: {out['noop']['seconds']} s", flush=True)
    table, change = change_table(ws, table, args.change, seed=1, sources=sources)
    out["change"] = run_job(embed_argv(ws, args.set), root / "change.log")
    check_counts("1% change", out["change"]["report"], {"changed": len(change.moved), "removed": len(
        change.removed), "added": len(change.added), "total": len(table)})
    print(f"[bench] 1% change: {out['change']['seconds']} s", flush=True)
    out["faiss_bytes"] = faiss_bytes(ws)
    out["services"] = [measure_service(ws, p, table, args) for p in args.partitions]
    table, out["served_after_change"] = served_after_change(ws, table, args, sources)
    out["items_served"] = len(table)
    if not args.keep:
        shutil.rmtree(ws.index, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- reporting


def gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def markdown(out: dict) -> str:
    n = out["n"]
    first, noop, change = out["first"], out["noop"], out["change"]
    ratio = change["seconds"] / first["seconds"] if not out["seeded"] else None
    how = out["first"].get("how", "seeded through the commit path (no image embedded)") if out["seeded"] \
        else "jobs/embed.py"
    lines = [f"Catalogue: a CSV table of {n:,} rows, {out['photo_files']:,} distinct photo files "
             f"(rows past them: hard links), the tiny PUMA model (16-d). First embed: {how}.",
             "", "| step | seconds | driver peak | embedded | added | changed | removed |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, step in (("first embed", first), ("no-op", noop), ("1% change", change)):
        r = step["report"]
        peak = gb(step["peak_rss_bytes"]) if "peak_rss_bytes" in step else "-"
        lines.append(f"| {name} | {step['seconds']} | {peak} | {r.get('embedded', '-')} | "
                     f"{r.get('added', '-')} | {r.get('changed', '-')} | {r.get('removed', '-')} |")
    if ratio is not None:
        lines += ["", f"1% change / first embed: **{ratio:.3f}**"]
    if "plan_seconds" in change["report"]:
        lines.append(f"planning of the 1% change: {change['report']['plan_seconds']} s")
    lines += ["", f"FAISS index: {gb(out['faiss_bytes'])}; {out['items_served']:,} items served.", "",
              "| partitions | ready s | query | clients | p50 ms | p99 ms | q/s |",
              "|---:|---:|---|---:|---:|---:|---:|"]
    for s in out["services"]:
        for kind in ("vector", "item_id"):
            for clients in (1, 8):
                m = s[f"{kind}_{clients}"]
                lines.append(f"| {s['partitions']} | {s['ready_s']} | {kind} | {clients} | {m['p50_ms']} | "
                             f"{m['p99_ms']} | {m['qps']} |")
    lines += ["", "Memory of every process of the service; for a process holding index shards, (RSS - its "
              "share of the FAISS bytes) / its share of the items (the issue's bound: 200 B).", "",
              "| partitions | process | RSS | anonymous | file-backed | (RSS - FAISS) / item |",
              "|---:|---|---:|---:|---:|---:|"]
    for s in out["services"]:
        for p in s["replicas"] + s["serve_process"]:
            holds = s["partitions"] if ":index-" in p["process"] else 1 if (
                ":ingress" in p["process"] and s["partitions"] == 1) else 0
            rss = p.get("VmRSS", 0)
            per = f"{(rss - out['faiss_bytes'] / holds) / (out['n'] / holds):.0f} B" if holds else "-"
            lines.append(f"| {s['partitions']} | {p['process'][:48]} | {gb(p.get('VmRSS', 0))} | "
                         f"{gb(p.get('RssAnon', 0))} | {gb(p.get('RssFile', 0))} | {per} |")
    c = out["served_after_change"]
    lines += ["", f"A second 1% change ({c['rows']:,} rows) while the service runs: served {c['served_s']} s "
                  f"after the job started (the job took {c['job_s']} s; watch interval 2 s)."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000, help="catalogue rows")
    p.add_argument("--photos", type=int, default=1_000_000, help="distinct photo files (rows past: links)")
    p.add_argument("--photos-dir", default="/tmp/puma-scale-photos", help="where the photo files are kept")
    p.add_argument("--scratch", default="", help="scratch folder (default /tmp/puma-scale-<n>)")
    p.add_argument("--seed-index", action="store_true", help="commit the first embed (module docstring)")
    p.add_argument("--reuse-index", action="store_true",
                   help="the index an earlier run left is the first embed")
    p.add_argument("--change", type=float, default=0.01, help="fraction of rows changed")
    p.add_argument("--requests", type=int, default=2000, help="queries per (kind, clients) row")
    p.add_argument("--partitions", type=int, nargs="+", default=[1, 2])
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for jobs/embed.py")
    p.add_argument("--keep", action="store_true", help="keep the index after the run")
    p.add_argument("--name", default="", help="results name (default bench_scale_<n>)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    name = args.name or f"bench_scale_{args.n}"
    record(name, out, markdown(out), title=f"The catalogue loop and the service at {args.n:,} rows")
    print(markdown(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
