"""Filtered search at 1M items: p50 latency and recall@10 against the exact filtered answer, at filter
selectivities from 50% to 0.01%, beside the unfiltered query, in one run.

    python bench/bench_filters.py                       # 1M x 64 IVF-Flat index (about 10 min on 2 cores)
    python bench/bench_filters.py --items 100000 --queries 50   # a quick run

Setup: --items synthetic clustered L2-normalised vectors (bench_index.clustered: a centre per 50
items), written by puma.index as a sharded IVF-Flat index (nlist by the plan, 4 x sqrt(N)), each item
with metadata {"bucket": uniform integer in [0, 10000), "colour": one of 8}: a filter
{"bucket": {"lt": t}} keeps t / 10000 of the items, independent of where they lie. The index is
searched as the service searches it (puma.serve.live_index.LiveIndex, in this process: FAISS, the
filter's selection, the hits' fields), with --nprobe lists (chosen so that the unfiltered search's
recall@10 is near 0.99, as a user tunes it; the unfiltered row shows it).

Rows, interleaved query by query (the same query vectors for every row):

    unfiltered        search_vector(q, 10)
    filter s, same    the same filter every query: its selection is evaluated once and cached
    filter s, new     a new filter every query ({"bucket": {"lt": t}, "colour": {"ne": c}} with c
                      varying): the selection is evaluated on the columns every time

recall@10: the hits against the exact top 10 of the matching items (numpy over every vector), computed
for every query before any is timed: done between the timed queries, the check's gather over up to 1M
rows and OpenBLAS's threads (which spin on after it and took the two cores from FAISS's) were measured
with the next query (the filtered rows' p50 rose by up to 3 ms).
ratio: the row's p50 / the unfiltered p50, interleaved with the filtered rows, and / the p50 of the
unfiltered query alone (200 back to back after a warm-up; interleaved, the unfiltered query shares
the caches with the filters' scans of whole columns, and its p50 moved between 1.8 and 5.2 ms from run
to run on one day, the same code, while the filtered rows moved far less).

The scan table measures puma.index.filtered.BRUTE_FORCE_VALUES: for filters keeping a fraction f, the
exact scan of the selected rows (their embeddings read from the replica's column file, then numpy)
against FAISS with the selection (nprobe / f lists, or every list); the scan is taken up to the
selection size where it stops being faster (rows x dim).

The crossover table measures puma.index.filtered.FULL_SCAN_SHARE: for filters keeping a fraction f,
the FAISS search alone (ShardedIndex.search_ids with the selection) visiting nprobe / f lists against
visiting every list; the full scan is taken where it is no slower, and FULL_SCAN_SHARE is the share of
the lists nprobe / f reaches there. Results: bench/results/bench_filters.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from bench.bench_index import clustered  # noqa: E402
from bench.record import record  # noqa: E402
from puma.config import IndexConfig  # noqa: E402
from puma.index import build_index, filtered  # noqa: E402
from puma.index.filters import parse_filter  # noqa: E402
from puma.index.search import Selection  # noqa: E402
from puma.serve.live_index import LiveIndex  # noqa: E402

SELECTIVITIES = (0.5, 0.05, 0.005, 0.0001)
BUCKETS, COLOURS = 10_000, ("red", "blue", "green", "black", "white", "grey", "brown", "pink")


def catalogue(n: int, dim: int, seed: int) -> tuple[pa.Table, np.ndarray, np.ndarray, np.ndarray]:
    """The index's rows, their vectors (n, dim), buckets (n,) and colour codes (n,) (a text column the
    filterable columns list)."""
    rng = np.random.default_rng(seed)
    x = clustered(n, dim, rng.standard_normal((max(1, n // 50), dim)).astype(np.float32), rng, 0.35)
    bucket, colour = rng.integers(0, BUCKETS, n), rng.integers(0, len(COLOURS), n)
    meta = [json.dumps({"bucket": int(b), "colour": COLOURS[c]}) for b, c in zip(bucket, colour, strict=True)]
    table = pa.table({"item_id": [f"i{i:08d}" for i in range(n)],
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), dim),
                      "dataset": ["synthetic"] * n, "metadata": meta})
    return table, x, bucket, colour


def exact(x: np.ndarray, keep: np.ndarray | None, q: np.ndarray, k: int) -> set[int]:
    """The rows of the k best items among ``keep`` (None: all) by inner product."""
    rows = np.arange(len(x)) if keep is None else np.flatnonzero(keep)
    scores = x @ q if keep is None else x[rows] @ q
    return set(rows[np.argsort(-scores, kind="stable")[:k]].tolist())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--nprobe", type=int, default=64)
    p.add_argument("--name", default="bench_filters")
    args = p.parse_args(argv)
    table, x, bucket, colour = catalogue(args.items, args.dim, seed=0)
    with tempfile.TemporaryDirectory(prefix="bench-filters-") as tmp:
        cfg = IndexConfig(uri=f"{tmp}/index", index_type="ivf_flat", use_gpu=False, nprobe=args.nprobe,
                          cache_dir=f"{tmp}/cache")
        start = time.perf_counter()
        build_index(cfg.uri, table, cfg, model_id="bench")
        built_s = time.perf_counter() - start
        del table
        live = LiveIndex(cfg, "bench", args.dim)
        nlist = live.state.manifest.nlist
        rows = measure(live, x, bucket, colour, args)
        scan = measure_scan(live, x, bucket, args)
        crossover = measure_crossover(live, x, bucket, args)
    payload = {"items": args.items, "dim": args.dim, "nlist": nlist, "nprobe": args.nprobe,
               "queries": args.queries, "build_s": round(built_s, 1), "rows": rows, "scan": scan,
               "brute_force_values": filtered.BRUTE_FORCE_VALUES, "crossover": crossover}
    record(args.name, payload, markdown(payload), f"Filtered search on a {args.items:,}-item IVF index")
    return 0


def measure(live: LiveIndex, x: np.ndarray, bucket: np.ndarray, colour: np.ndarray,
            args: argparse.Namespace) -> list[dict]:
    rng = np.random.default_rng(1)
    queries = x[rng.integers(0, len(x), args.queries)] + 0.05 * rng.standard_normal((args.queries, args.dim))
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
    plan = []  # per query: (row, filter, bucket range) for every row, interleaved in this order
    for _ in queries:
        asks = [("unfiltered", None, (0, BUCKETS))]
        for s in SELECTIVITIES:
            t = max(1, round(s * BUCKETS))
            low = int(rng.integers(0, BUCKETS - t + 1))  # another range of the same width: a new filter
            asks += [(f"{s}/same", {"bucket": {"lt": t}}, (0, t)),
                     (f"{s}/new", {"bucket": {"gte": low, "lt": low + t}}, (low, low + t))]
        plan.append(asks)
    # The exact answers first: the check's own work (a gather over up to 1M rows, and OpenBLAS's threads,
    # which spin on after it and took the cores from FAISS's) stays out of the timed queries.
    wanted = [[exact(x, (bucket >= lo) & (bucket < hi) if hi - lo < BUCKETS else None, q, 10)
               for _, _, (lo, hi) in asks] for q, asks in zip(queries, plan, strict=True)]
    counts = np.bincount(bucket, minlength=BUCKETS).cumsum()  # items below each bucket's end
    matching = [[int(counts[hi - 1] - (counts[lo - 1] if lo else 0)) for _, _, (lo, hi) in asks]
                for asks in plan]
    alone = Row("unfiltered, alone", 1.0)  # back to back, warm: the interleaved rows below share the
    for q in queries[:20]:  # caches with the filters' column scans, which slows the unfiltered query too
        live.search_vector(q, 10)
    for q, want in zip(queries, wanted, strict=True):
        alone.ask(live, q, None, want[0], len(x))
    rows = {"unfiltered": Row("unfiltered", 1.0)}
    for s in SELECTIVITIES:
        rows[f"{s}/same"] = Row(f"filter {s:.2%}, same", s)
        rows[f"{s}/new"] = Row(f"filter {s:.2%}, new", s)
    for q, asks, want, match in zip(queries, plan, wanted, matching, strict=True):  # interleaved by query
        for (name, where, _), answer, n in zip(asks, want, match, strict=True):
            rows[name].ask(live, q, where, answer, n)
    base, warm = rows["unfiltered"].p50(), alone.p50()
    return [r.summary(base, warm) for r in (alone, *rows.values())]


CROSSOVER_FRACTIONS = (0.5, 0.3, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01)


def for_faiss(mask: np.ndarray) -> Selection:
    """A selection FAISS searches whatever its size (the bench's index has no id gaps: rows = ids)."""
    return Selection(np.packbits(mask, bitorder="little"), len(mask), int(mask.sum()))
SCAN_FRACTIONS = (0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 0.005)


def measure_scan(live: LiveIndex, x: np.ndarray, bucket: np.ndarray, args: argparse.Namespace) -> list[dict]:
    """Per fraction f: the exact scan of the selected rows against FAISS with the selection (p50 ms)."""
    index = live.state.index
    rng = np.random.default_rng(3)
    queries = x[rng.integers(0, len(x), args.queries)].astype(np.float32)
    out = []
    for f in SCAN_FRACTIONS:
        mask = (bucket < round(f * BUCKETS)) & index.live
        chosen = for_faiss(mask)
        ways = {"faiss": chosen,  # no rows: FAISS
                "scan": Selection(chosen.bits, chosen.size, chosen.count, np.flatnonzero(mask))}
        times = {name: [] for name in ways}
        for q in queries:
            for name, selection in ways.items():
                start = time.perf_counter()
                index.search_ids(q[None, :], 10, allowed=selection)
                times[name].append(time.perf_counter() - start)
        out.append({"fraction": f, "rows": int(chosen.count), "values": int(chosen.count) * args.dim,
                    **{f"{name}_p50_ms": round(float(np.median(t)) * 1000, 2) for name, t in times.items()}})
    return out


def measure_crossover(live: LiveIndex, x: np.ndarray, bucket: np.ndarray,
                      args: argparse.Namespace) -> list[dict]:
    """FAISS alone, per fraction f: nprobe / f lists against every list (p50 ms over the queries)."""
    index = live.state.index
    nlist = index.manifest.nlist
    rng = np.random.default_rng(2)
    queries = x[rng.integers(0, len(x), args.queries)].astype(np.float32)
    out = []
    for f in CROSSOVER_FRACTIONS:
        chosen = for_faiss((bucket < round(f * BUCKETS)) & index.live)
        unscaled = Selection(chosen.bits, chosen.size)  # count -1: nprobe as given
        scaled = min(nlist, math.ceil(args.nprobe / f))
        times = {"scaled": [], "full": []}
        for q in queries:
            for name, nprobe in (("scaled", scaled), ("full", nlist)):
                start = time.perf_counter()
                index.search_ids(q[None, :], 10, nprobe=nprobe, allowed=unscaled)
                times[name].append(time.perf_counter() - start)
        row = {"fraction": f, "lists_scaled": scaled, "share_of_lists": round(scaled / nlist, 3),
               **{f"{name}_p50_ms": round(float(np.median(t)) * 1000, 2) for name, t in times.items()}}
        out.append(row)
    return out


class Row:
    def __init__(self, name: str, selectivity: float) -> None:
        self.name, self.selectivity = name, selectivity
        self.seconds: list[float] = []
        self.recalls: list[float] = []
        self.short = 0

    def ask(self, live: LiveIndex, q: np.ndarray, where: dict | None, want: set[int], matching: int) -> None:
        parsed = None if where is None else parse_filter(where)
        start = time.perf_counter()
        hits = live.search_vector(q, 10, where=parsed)
        self.seconds.append(time.perf_counter() - start)
        got = {int(h["item_id"][1:]) for h in hits}
        self.short += len(got) < min(10, matching)
        self.recalls.append(len(got & want) / len(want) if want else float(not got))

    def p50(self) -> float:
        return float(np.median(self.seconds)) * 1000

    def summary(self, base_ms: float, alone_ms: float) -> dict:
        ms = np.array(self.seconds) * 1000
        return {"row": self.name, "selectivity": self.selectivity,
                "p50_ms": round(float(np.median(ms)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
                "x_unfiltered": round(self.p50() / base_ms, 2),
                "x_unfiltered_alone": round(self.p50() / alone_ms, 2),
                "recall_at_10": round(float(np.mean(self.recalls)), 4),
                "min_recall_at_10": round(float(np.min(self.recalls)), 2), "short_answers": self.short}


def markdown(payload: dict) -> str:
    lines = [f"{payload['items']:,} items x {payload['dim']}-d, IVF-Flat nlist {payload['nlist']}, nprobe "
             f"{payload['nprobe']}, k = 10, {payload['queries']} queries per row; LiveIndex in process "
             f"(FAISS, the filter's selection, the hits); index built in {payload['build_s']} s.", "",
             "| row | p50 ms | p99 ms | x unfiltered p50 | x unfiltered alone | recall@10 | min recall@10 "
             "| short answers |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in payload["rows"]:
        lines.append(f"| {r['row']} | {r['p50_ms']} | {r['p99_ms']} | {r['x_unfiltered']} | "
                     f"{r['x_unfiltered_alone']} | "
                     f"{r['recall_at_10']} | {r['min_recall_at_10']} | {r['short_answers']} |")
    lines += ["", "Exact scan against FAISS (ShardedIndex.search_ids alone): a filter keeping f; the scan "
              f"reads the selected rows' embeddings and ranks them; taken while rows x dim <= "
              f"{payload['brute_force_values']:,} (BRUTE_FORCE_VALUES).", "",
              "| f | rows | rows x dim | FAISS p50 ms | exact scan p50 ms |", "|---:|---:|---:|---:|---:|"]
    for r in payload["scan"]:
        lines.append(f"| {r['fraction']} | {r['rows']:,} | {r['values']:,} | {r['faiss_p50_ms']} | "
                     f"{r['scan_p50_ms']} |")
    lines += ["", "Crossover (FAISS alone): a filter keeping f, nprobe / f lists against every list.", "",
              "| f | lists nprobe / f | share of the lists | nprobe / f p50 ms | every list p50 ms |",
              "|---:|---:|---:|---:|---:|"]
    for r in payload["crossover"]:
        lines.append(f"| {r['fraction']} | {r['lists_scaled']} | {r['share_of_lists']} | "
                     f"{r['scaled_p50_ms']} | {r['full_p50_ms']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
