"""Curves of the recipe lab runs (bench/recipe_lab.py): one PNG per quantity, runs side by side.

    .venv/bin/python bench/recipe_plots.py base_2e-5 paper_lr lsPC_1e-4 --out bench/results/recipe_lab

Reads bench/results/recipe_lab/<name>.json; draws training loss, validation harmonic R@1 (step 0 =
the initial model), the embedding's effective rank (collapse shows as a drop towards 1), proxy
norm, and the adapter update relative to its sub-block's own update per block (mean over the run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LAB = Path(__file__).resolve().parent / "results" / "recipe_lab"


def load(name: str) -> dict:
    return json.loads((LAB / f"{name}.json").read_text())


def series(run: dict, key: str, with_init: bool = False) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the logged curve (plus step 0 from the initial evaluation)."""
    points = [(0, run["init"][key])] if with_init and key in run.get("init", {}) else []
    points += [(row["step"], row[key]) for row in run["curves"] if key in row]
    return [p[0] for p in points], [p[1] for p in points]


def color(runs: dict[str, dict], name: str) -> str:
    """One colour per run, the same in every plot (the order the runs were named in)."""
    return f"C{list(runs).index(name) % 10}"


def plot_key(runs: dict[str, dict], key: str, title: str, out: Path, with_init: bool = False) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, run in runs.items():
        steps, values = series(run, key, with_init)
        if steps:
            ax.plot(steps, values, marker="o", markersize=3, label=name, color=color(runs, name))
    ax.set_xlabel("step (batch 64)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = out / f"{key.replace('/', '_').replace('@', '')}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_blocks(runs: dict[str, dict], out: Path) -> Path:
    """Adapter update / sub-block update per block, averaged over the logged steps."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, run in runs.items():
        keys = sorted({k for row in run["curves"] for k in row if k.startswith("adapter_vs_block/")},
                      key=lambda k: int(k.rsplit("/", 1)[1]))
        if keys:
            means = [sum(r[k] for r in run["curves"] if k in r) / sum(k in r for r in run["curves"])
                     for k in keys]
            ax.plot([int(k.rsplit("/", 1)[1]) for k in keys], means, marker="o", markersize=3, label=name,
                    color=color(runs, name))
    ax.set_xlabel("block")
    ax.set_title("adapter update / the sub-block's own update")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = out / "adapter_vs_block.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+")
    parser.add_argument("--out", default=str(LAB))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {name: load(name) for name in args.names}
    paths = [plot_key(runs, "loss", "training loss", out),
             plot_key(runs, "harmonic/r@1", "validation harmonic R@1", out, with_init=True),
             plot_key(runs, "emb/eff_rank", "embedding effective rank (validation)", out, with_init=True),
             plot_key(runs, "proxy_norm", "mean proxy norm", out),
             plot_blocks(runs, out)]
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
