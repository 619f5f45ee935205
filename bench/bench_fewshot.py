"""Few-shot curve on the embedded default's data: harmonic R@1 against k training images per class.

PUMA, linear and full fine-tuning each train through jobs/train.py's code path (bench/bench_methods.py:
configs/demo.yaml's data, recipe and 3 epochs, each method's own base rate from bench/method_lr.yaml)
on ``data.shots_per_class=k`` images per training class (puma/data/fewshot.py: the same k images for
every method and seed), for k in {1, 2, 4, 8, 16}, and are evaluated once at the end on the whole
test split. Zero-shot (the frozen backbone) is the k = 0 point. Results are stored per (method, k,
seed) as they finish, so an interrupted run continues where it stopped.

    .venv/bin/python bench/bench_fewshot.py                          # 3 methods x 5 k x seeds 0 1 2
    .venv/bin/python bench/bench_fewshot.py --seeds 0 --shots 1 4 16
    .venv/bin/python bench/bench_fewshot.py --table-only

Writes bench/results/fewshot.{json,md}: per method and k, the mean +- std over seeds of harmonic and
unified R@1 (rows: {"method", "shots", "harmonic_r1_mean", "harmonic_r1_std", ...}), read by
jobs/report.py to draw the curve.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_methods import DEMO, _store, run_one  # noqa: E402
from bench.record import RESULTS, record  # noqa: E402
from puma import storage  # noqa: E402
from puma.methods import load_config  # noqa: E402

METHODS = ("puma", "linear", "full_finetune")
SHOTS = (1, 2, 4, 8, 16)


def result_path(out: Path, method: str, shots: int, seed: int) -> Path:
    return out / method / f"k{shots:02d}_seed{seed}.json"


def run_all(args: argparse.Namespace, out: Path) -> None:
    """Every (seed, method, k) not stored yet, seed first so that early results make whole curves."""
    from puma.runtime import init_ray

    storage.configure(load_config(DEMO).storage)
    print(f"[bench] Ray: {init_ray()}", flush=True)
    for seed in args.seeds:
        for method in args.methods:
            for shots in args.shots:
                path = result_path(out, method, shots, seed)
                if path.is_file() and "error" not in json.loads(path.read_text()):
                    continue
                need_zero_shot = not (out / "zero_shot.json").is_file()
                run_args = argparse.Namespace(epochs=0, steps=0, overrides=[f"data.shots_per_class={shots}"])
                try:
                    metrics = run_one(method, seed, out / f"k{shots:02d}", run_args, need_zero_shot)
                except Exception as exc:  # noqa: BLE001 - recorded as a failed point, never dropped
                    traceback.print_exc()
                    metrics = {"error": f"{type(exc).__name__}: {exc}"}
                if need_zero_shot and "error" not in metrics:
                    _store(out / "zero_shot.json", {k[len("before/"):]: v for k, v in metrics.items()
                                                    if k.startswith("before/")})
                _store(path, metrics)
                print(f"[bench] {method} k={shots} seed {seed}: harmonic r@1 "
                      f"{metrics.get('harmonic/r@1', float('nan')):.4f}", flush=True)


def summarise(out: Path, args: argparse.Namespace) -> list[dict]:
    """One row per (method, k) with results: mean and population std over the seeds found."""
    rows = []
    zero = json.loads((out / "zero_shot.json").read_text()) if (out / "zero_shot.json").is_file() else None
    if zero:
        rows.append(_row("zero_shot", 0, [zero]))
    for method in args.methods:
        for shots in args.shots:
            runs = [json.loads(p.read_text()) for s in args.seeds
                    if (p := result_path(out, method, shots, s)).is_file()]
            runs = [r for r in runs if "error" not in r]
            if runs:
                rows.append(_row(method, shots, runs))
    return rows


def _row(method: str, shots: int, runs: list[dict]) -> dict:
    out: dict = {"method": method, "shots": shots, "seeds": len(runs)}
    for key, name in (("harmonic/r@1", "harmonic_r1"), ("unified/r@1", "unified_r1")):
        values = np.asarray([r[key] for r in runs], dtype=np.float64)
        out[f"{name}_mean"], out[f"{name}_std"] = float(values.mean()), float(values.std())
    return out


def table(rows: list[dict]) -> str:
    lines = ["| method | k (images per class) | harmonic R@1 | unified R@1 | seeds |", "|---" * 5 + "|"]
    for r in rows:
        spread = r["seeds"] > 1
        cells = [f"{r[f'{n}_mean']:.4f}" + (f" ± {r[f'{n}_std']:.4f}" if spread else "")
                 for n in ("harmonic_r1", "unified_r1")]
        lines.append(f"| {r['method']} | {r['shots']} | {cells[0]} | {cells[1]} | {r['seeds']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--shots", nargs="+", type=int, default=list(SHOTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench" / "fewshot"))
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not args.table_only:
        run_all(args, out)
    rows = summarise(out, args)
    text = table(rows)
    print(text)
    payload = {"rows": rows, "seeds": args.seeds, "shots": args.shots}
    record("fewshot", payload, text + "\n\n![few-shot curve](fewshot.png)",
           title="Few-shot: harmonic R@1 against training images per class (demo data, test split)")
    if rows:
        from puma.report.figures import fewshot_curve

        (RESULTS / "fewshot.png").write_bytes(fewshot_curve(rows))  # drawn on docs/performance.md
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
