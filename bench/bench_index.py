"""Sharded IVF index vs exact search: build time, search QPS and recall@10, side by side in one run.

    python bench/bench_index.py                      # 1M x 128, the issue's setting (~3 min on 2 cores)
    python bench/bench_index.py --n 100000           # a quick run

Data: synthetic clustered float32 vectors (``--clusters`` Gaussian centres, noise, L2-normalised),
queries drawn from the same distribution but not indexed. Rows, all built by ``puma.index``
(files, Parquet, checksums and manifest included) except the first:

    exact, 1 in-memory IndexFlatIP    the ground truth (no files)
    exact, sharded flat               puma.index type flat: the same exact answers, from shards
    IVF, sharded (nprobe=p)           puma.index type ivf_flat or ivf_pq, trained once, shared

recall@10 = |top-10 of the row  ∩  exact top-10| / 10, averaged over queries. QPS = queries / wall
seconds of ``ShardedIndex.search`` (item ids included), all queries in one call, fastest of
``--repeat`` calls; QPS/cpu divides by the process's CPU seconds instead (all threads), which moves
less than wall time when other jobs share the cores. Ratios are against
the sharded exact index (same files, same shards), so they isolate what IVF buys.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import faiss  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from puma.config import IndexConfig  # noqa: E402
from puma.index import ShardedIndex, add_items, create_index, read_manifest  # noqa: E402
from puma.index.table import embedding_matrix  # noqa: E402


@dataclass
class Row:
    name: str
    build_s: float  # train + add (shards, Parquet, checksums, manifest)
    train_s: float
    qps: float  # queries per wall second
    qps_cpu: float  # queries per CPU second (all threads): steadier when the machine is shared
    recall: float
    index_bytes: int = 0


def clustered(n: int, dim: int, centres: np.ndarray, rng: np.random.Generator, noise: float) -> np.ndarray:
    """n L2-normalised points around random centres: (n, dim) float32, generated in blocks."""
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        block = centres[rng.integers(0, len(centres), m)] + noise * rng.standard_normal((m, dim), np.float32)
        out[start:start + m] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of |found ∩ truth| / k for (Q, k) id arrays."""
    hits = [len(np.intersect1d(f, t)) for f, t in zip(found, truth, strict=True)]
    return float(np.mean(hits)) / truth.shape[1]


def best_of(repeat: int, fn):
    """(fastest wall seconds, fewest CPU seconds, last result) of ``repeat`` calls of fn()."""
    wall, cpu, result = [], [], None
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(wall), min(cpu), result


def exact_reference(x: np.ndarray, q: np.ndarray, k: int, repeat: int) -> tuple[Row, np.ndarray]:
    """One in-memory IndexFlatIP: the ground truth ids (Q, k)."""
    start = time.perf_counter()
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    build = time.perf_counter() - start
    wall, cpu, (_, ids) = best_of(repeat, lambda: index.search(q, k))
    return Row("exact, 1 in-memory IndexFlatIP", build, 0.0, len(q) / wall, len(q) / cpu, 1.0, x.nbytes), ids


def sharded(name: str, uri: str, table: pa.Table, cfg: IndexConfig, q: np.ndarray, truth: np.ndarray,
            k: int, nprobes: list[int], repeat: int) -> list[Row]:
    """Build with puma.index, then search once per nprobe; one Row each."""
    start = time.perf_counter()
    create_index(uri, cfg, embedding_matrix(table), expected_items=len(table))  # what build_index does
    train = time.perf_counter() - start
    add_items(uri, table)
    build = time.perf_counter() - start
    index = ShardedIndex.open(uri, use_gpu=cfg.use_gpu)
    size = sum(p.stat().st_size for p in Path(uri).rglob("index.faiss"))
    rows = []
    for nprobe in nprobes:
        wall, cpu, (_, item_ids) = best_of(repeat, lambda p=nprobe: index.search(q, k, nprobe=p))
        found = np.array([[int(i[1:]) if i else -1 for i in row] for row in item_ids])  # "v<row>" -> row
        label = name if read_manifest(uri).nlist == 0 else f"{name} (nprobe={nprobe})"
        rows.append(Row(label, build, train, len(q) / wall, len(q) / cpu, recall_at(found, truth), size))
    return rows


def print_table(rows: list[Row], base: Row) -> None:
    print(f"{'index':36s} {'build s':>8s} {'(train)':>8s} {'x exact':>8s} {'QPS':>8s} {'x exact':>8s} "
          f"{'QPS/cpu':>8s} {'x exact':>8s} {'recall@10':>9s} {'index MB':>9s}")
    for r in rows:
        print(f"{r.name:36s} {r.build_s:8.1f} {r.train_s:8.1f} {r.build_s / base.build_s:8.2f} {r.qps:8.0f} "
              f"{r.qps / base.qps:8.1f} {r.qps_cpu:8.0f} {r.qps_cpu / base.qps_cpu:8.1f} {r.recall:9.4f} "
              f"{r.index_bytes / 2**20:9.0f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000, help="indexed vectors (default 1M)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--clusters", type=int, default=2000, help="Gaussian centres of the synthetic data")
    p.add_argument("--noise", type=float, default=1.5, help="noise scale around the centres")
    p.add_argument("--index-type", default="ivf_flat", choices=["ivf_flat", "ivf_pq"])
    p.add_argument("--nlist", type=int, default=0, help="0: the sqrt rule (4096 at 1M)")
    p.add_argument("--pq-m", type=int, default=0)
    p.add_argument("--nprobe", default="8,16,64", help="comma-separated nprobe values to search with")
    p.add_argument("--shard-size", type=int, default=250_000)
    p.add_argument("--workdir", default="", help="where the indexes go (default: a temp dir, deleted)")
    p.add_argument("--repeat", type=int, default=3, help="searches timed per row; the fastest counts")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    centres = rng.standard_normal((args.clusters, args.dim), np.float32)
    x = clustered(args.n, args.dim, centres, rng, args.noise)  # (N, E)
    q = clustered(args.queries, args.dim, centres, rng, args.noise)  # (Q, E)
    table = pa.table({"item_id": pa.array(np.char.add("v", np.arange(args.n).astype(str))),
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), args.dim)})
    print(f"[bench] {args.n} x {args.dim} float32, {args.queries} queries, k={args.k}, faiss "
          f"{faiss.__version__}, {faiss.omp_get_max_threads()} threads, {faiss.get_num_gpus()} GPU(s)")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_index_"))
    try:
        reference, truth = exact_reference(x, q, args.k, args.repeat)
        common = dict(shard_size=args.shard_size, memory_budget_gb=20.0)
        flat = sharded("exact, sharded flat", str(work / "flat"), table,
                       IndexConfig(index_type="flat", **common), q, truth, args.k, [1], args.repeat)[0]
        ivf_cfg = IndexConfig(index_type=args.index_type, nlist=args.nlist, pq_m=args.pq_m, **common)
        nprobes = [int(v) for v in args.nprobe.split(",")]
        ivf = sharded(f"{args.index_type}, sharded", str(work / "ivf"), table, ivf_cfg, q, truth, args.k,
                      nprobes, args.repeat)
        manifest = read_manifest(str(work / "ivf"))
        print(f"[bench] IVF: {manifest.factory}, {len(manifest.shards)} shards of <= {args.shard_size}, "
              f"trained on {manifest.train_count} vectors; ratios are against 'exact, sharded flat'")
        print_table([reference, flat, *ivf], flat)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"[bench] peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
