"""Each baseline's base learning rate for bench/bench_methods.py, found by tune/sweep.py on validation
classes.

PUMA's rate comes from the recipe sweep (tune/recipe_space.yaml: the rate with five other knobs).
For every other method of the comparison, one sweep over ``optim.lr`` alone (tune/method_lr_space.yaml)
on top of configs/demo.yaml and the method's own overrides, at the demo's budget (3 epochs),
scored on the held-out validation classes of the training split (sweep.val_fraction=0.4: the
same split the recipe sweep used), never the test split. The space is a grid, so every method
tries the same rates (ASHA stops the weak ones after an epoch). The best rate goes to
bench/method_lr.yaml with the trial it came from; each sweep's trials.md is copied to
tune/results/method_lr/<method>.md.

    .venv/bin/python bench/method_lr_search.py                     # every method without an lr
    .venv/bin/python bench/method_lr_search.py --methods linear vpt

Re-running resumes: a method already in bench/method_lr.yaml is skipped (``--force`` redoes it) and
an interrupted sweep continues (tune/sweep.py resumes a sweep of the same name).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_methods import METHOD_LR, METHODS, ZERO_SHOT  # noqa: E402

SPACE = ROOT / "tune" / "method_lr_space.yaml"
TRIALS = ROOT / "tune" / "results" / "method_lr"
SWEEPS = ROOT / "artifacts" / "runs" / "sweeps"


def sweep_command(method: str) -> list[str]:
    """tune/sweep.py over the lr grid for ``method`` (its bench overrides on top of the demo)."""
    from puma.sweep.space import grid_points, read_space

    samples = grid_points(read_space(str(SPACE)))
    return [sys.executable, str(ROOT / "tune" / "sweep.py"), "--config", str(ROOT / "configs" / "demo.yaml"),
            "--space", str(SPACE), f"sweep.name=lr-{method}", f"sweep.num_samples={samples}",
            "sweep.val_fraction=0.4", f"sweep.storage_path={SWEEPS}", "train.epochs=3", *METHODS[method]]


def record_best(method: str) -> dict:
    """Read the sweep's summary, copy its trials.md, and write the best lr to bench/method_lr.yaml."""
    results = SWEEPS / f"lr-{method}" / "results"
    summary = json.loads((results / "summary.json").read_text())
    TRIALS.mkdir(parents=True, exist_ok=True)
    shutil.copy(results / "trials.md", TRIALS / f"{method}.md")
    best = summary["best"]
    entry = {"lr": float(f"{best['params']['optim.lr']:.3g}"),
             "source": f"tune/results/method_lr/{method}.md (trial {best['trial_id']}, validation "
                       f"harmonic R@1 {best['objective']:.4f}, validation classes)"}
    data = yaml.safe_load(METHOD_LR.read_text()) or {}
    data.setdefault("methods", {})[method] = entry
    METHOD_LR.write_text(METHOD_LR.read_text().split("methods:")[0] + yaml.safe_dump(data, sort_keys=False))
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = [m for m in METHODS if m not in (ZERO_SHOT, "puma")]  # PUMA's: the recipe sweep
    parser.add_argument("--methods", nargs="+", default=choices, choices=choices)
    parser.add_argument("--force", action="store_true", help="search methods that have an lr already")
    args = parser.parse_args(argv)
    done = (yaml.safe_load(METHOD_LR.read_text()) or {}).get("methods", {})
    for method in args.methods:
        if method in done and not args.force:
            print(f"[bench] {method}: lr {done[method]['lr']} already chosen ({done[method]['source']})")
            continue
        print(f"[bench] {method}: sweeping optim.lr", flush=True)
        result = subprocess.run(sweep_command(method), cwd=ROOT)
        if result.returncode != 0:
            print(f"[bench] {method}: the sweep failed (exit {result.returncode}); no lr", flush=True)
            continue
        entry = record_best(method)
        print(f"[bench] {method}: lr {entry['lr']} ({entry['source']})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
