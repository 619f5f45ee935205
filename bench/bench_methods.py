"""Method comparison over seeds on the embedded default's data: one budget, each method's own lr.

Every method trains through jobs/train.py's code path (Ray Train, configs/demo.yaml's data, offline
backbone, recipe and budget) once per seed, with its own base learning rate from
bench/method_lr.yaml (each found by tune/sweep.py on validation classes, never the test split), and
is evaluated once at the end on the test split. Zero-shot is the frozen backbone's own features.

    .venv/bin/python bench/bench_methods.py                       # the 9 methods x 3 seeds (hours)
    .venv/bin/python bench/bench_methods.py --methods linear puma --seeds 0
    .venv/bin/python bench/bench_methods.py --table-only           # the table of stored results

Prints per-dataset, unified and harmonic R@1 and MAP@R as mean +- std over seeds (population std;
n in the header), trainable parameters and training seconds; writes bench/results/methods.json and
methods.md. Each (method, seed) is stored under ``--out`` as soon as it finishes, so an interrupted
comparison continues where it stopped (``--force`` re-trains). A method that fails is reported as
such in the table, never silently left out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.record import commit, record  # noqa: E402
from puma import storage  # noqa: E402
from puma.config import Config  # noqa: E402
from puma.methods import load_config  # noqa: E402

DEMO = ROOT / "configs" / "demo.yaml"
METHOD_LR = ROOT / "bench" / "method_lr.yaml"
ZERO_SHOT = "zero_shot"
# name in the table -> overrides on top of configs/demo.yaml (the paper's Table 2(c) rows)
METHODS: dict[str, list[str]] = {
    ZERO_SHOT: [],
    "linear": ["model.method=linear"],
    "mlp3": ["model.method=mlp3", "model.head.init=random"],  # PCA init is for the linear head
    # Table 3's "Stat.": PUMA's adapters with p = 1 and no prompt pool (our adaptformer builds the same
    # model; the paper's AdaptFormer adapts the MLP only)
    "static_adapter": ["model.method=puma", "model.adapter.keep_prob=1.0", "model.prompt_pool.enabled=false"],
    "vpt": ["model.method=vpt_deep"],
    "lora": ["model.method=lora"],
    "adaptformer": ["model.method=adaptformer"],  # static adapters, no prompt pool
    "full_finetune": ["model.method=full_finetune"],
    "puma": ["model.method=puma"],
}
EXTRA: dict[str, list[str]] = {  # the sibling methods, not in the default comparison; run them by name
    "vptsp_g": ["model.method=vptsp_g", "loss.name=proxy_anchor", "loss.proxy_init=random"],
    "udml_ss": ["model.method=udml_ss", "model.head.init=random", "loss.proxy_init=random"],
    "puma_p1": ["model.method=puma", "model.adapter.keep_prob=1.0"],  # PUMA's ablation of p: pool kept
    "stochastic_adapter": ["model.method=puma", "model.prompt_pool.enabled=false"],  # Table 3 "Stoc."
}
KEYS = ("r@1", "map@r")
COMMIT = "_commit"  # per run: the code it trained with (a table may join runs of several commits)


def method_lrs() -> dict[str, float]:
    """Each method's base learning rate (bench/method_lr.yaml)."""
    data = yaml.safe_load(METHOD_LR.read_text()) or {}
    return {name: float(entry["lr"]) for name, entry in data.get("methods", {}).items()}


def method_config(name: str, seed: int, out: Path, args: argparse.Namespace) -> Config:
    """configs/demo.yaml <- the method's overrides <- its lr <- this seed's run under ``out``."""
    overrides = list({**METHODS, **EXTRA}[name])
    lrs = method_lrs()
    if name in lrs:
        overrides.append(f"optim.lr={lrs[name]}")
    overrides += [f"train.seed={seed}", f"train.run_name={name}-seed{seed}",
                  f"train.storage_path={out / 'runs'}"]
    if args.epochs:
        overrides.append(f"train.epochs={args.epochs}")
    if args.steps:
        overrides.append(f"train.max_steps_per_epoch={args.steps}")
    overrides += args.overrides
    return load_config(DEMO, overrides)


def trainable_parameters(cfg: Config) -> int:
    """Trainable scalars of the model (the loss's proxies are counted apart, as in the paper)."""
    from puma.methods import build_model
    from puma.models.trainable import count_trainable

    return count_trainable(build_model(cfg.model))


def run_one(name: str, seed: int, out: Path, args: argparse.Namespace, need_zero_shot: bool) -> dict:
    """Train one method with one seed; returns its final metrics (plus before/ when evaluated)."""
    from puma.train.driver import run_training

    cfg = method_config(name, seed, out, args)
    cfg.train.eval_every = cfg.train.epochs  # evaluate once, at the end
    cfg.train.eval_before = need_zero_shot
    storage.delete(str(out / "runs" / f"{name}-seed{seed}"))  # a stale run must not resume
    start = time.perf_counter()
    outcome = run_training(cfg)
    metrics = {k: float(v) for k, v in outcome.metrics.items() if isinstance(v, (int, float))}
    metrics["bench/seconds"] = time.perf_counter() - start
    metrics["bench/trainable"] = trainable_parameters(cfg)
    metrics["bench/lr"] = cfg.optim.lr
    metrics[COMMIT] = _commit()
    return metrics


def _commit() -> str:
    """The checkout's short commit (bench.record.commit), "+dirty" when it had uncommitted changes."""
    state = commit()
    return state["commit"][:7] + ("+dirty" if state["dirty"] else "")


def result_path(out: Path, name: str, seed: int) -> Path:
    return out / name / f"seed{seed}.json"


def load_results(out: Path, names: list[str], seeds: list[int]) -> dict[str, list[dict]]:
    """Stored results per method (a list over the seeds found)."""
    found: dict[str, list[dict]] = {}
    for name in names:
        runs = [json.loads(p.read_text()) for s in seeds if (p := result_path(out, name, s)).is_file()]
        if name == ZERO_SHOT and (out / ZERO_SHOT / "metrics.json").is_file():
            runs = [json.loads((out / ZERO_SHOT / "metrics.json").read_text())]
        if runs:
            found[name] = runs
    return found


def summarise(results: dict[str, list[dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """method -> metric -> {mean, std, n}; failed runs are listed under "errors"."""
    out: dict[str, dict] = {}
    for name, runs in results.items():
        good = [r for r in runs if "error" not in r]
        keys = sorted({k for r in good for k in r if not k.startswith(("before/", "best/", "_"))})
        out[name] = {k: _stats([r[k] for r in good if k in r]) for k in keys}
        out[name][COMMIT] = sorted({r.get(COMMIT, "?") for r in good})
        out[name]["errors"] = [r["error"] for r in runs if "error" in r]
    return out


def _stats(values: list[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), "std": float(array.std()), "n": len(values)}


def table(summary: dict[str, dict], names: list[str]) -> str:
    """Markdown: a block per metric (datasets, unified, harmonic) plus parameters and seconds."""
    cols = [n for n in names if n in summary]
    datasets = sorted({k.split("/")[0] for s in summary.values() for k in s if k.count("/") == 1
                       and k.endswith("/r@1")} - {"unified", "harmonic", "bench", "train"})
    lines = ["| metric | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for key in KEYS:
        for row in [*datasets, "unified", "harmonic"]:
            cells = [_cell(summary[m], f"{row}/{key}") for m in cols]
            lines.append(f"| {row} {key} | " + " | ".join(cells) + " |")
    for label, key, fmt, spread in (("trainable params", "bench/trainable", "{:,.0f}", False),
                                    ("lr", "bench/lr", "{:.1e}", False),
                                    ("seconds", "bench/seconds", "{:.0f}", True)):
        lines.append(f"| {label} | " + " | ".join(_cell(summary[m], key, fmt, spread) for m in cols) + " |")
    lines.append("| seeds | " + " | ".join(str(_n(summary[m])) for m in cols) + " |")
    lines.append("| commit | " + " | ".join(", ".join(summary[m].get(COMMIT, [])) for m in cols) + " |")
    return "\n".join(lines)


def _n(entry: dict) -> int:
    return max((v["n"] for k, v in entry.items() if k not in ("errors", COMMIT)), default=0)


def _cell(entry: dict, key: str, fmt: str = "{:.4f}", spread: bool = True) -> str:
    if key not in entry:
        return "n/a" if entry.get("errors") else "-"
    value = entry[key]
    text = fmt.format(value["mean"])
    return f"{text} ± {fmt.format(value['std'])}" if spread and value["n"] > 1 else text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=[*METHODS, *EXTRA])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=0, help="override the demo's epochs (0: keep)")
    parser.add_argument("--steps", type=int, default=0, help="cap steps per epoch (0: whole epochs)")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench" / "methods"))
    parser.add_argument("--name", default="methods", help="results file stem under bench/results/")
    parser.add_argument("--force", action="store_true", help="re-train methods that have results")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every method")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not args.table_only:
        _run_all(args, out)
    results = load_results(out, args.methods, args.seeds)
    summary = summarise(results)
    text = table(summary, args.methods)
    print(text)
    notes = [f"{m}: {e}" for m, s in summary.items() for e in s["errors"]]
    record(args.name, {"summary": summary, "runs": results, "seeds": args.seeds, "notes": notes},
           text + ("\n\n" + "\n".join(f"- failed: {n}" for n in notes) if notes else ""),
           title=f"Methods on the demo data: mean ± std over seeds ({_split_name(args.overrides)})")
    return 0


def _split_name(overrides: list[str]) -> str:
    """What the table's runs were evaluated on, from the overrides (the demo's own: the test split)."""
    cfg = load_config(DEMO, overrides)
    if cfg.train.eval_split == "val":
        return f"validation classes, data.val_fraction={cfg.data.val_fraction:g}"
    return f"{cfg.train.eval_split} split"


def _run_all(args: argparse.Namespace, out: Path) -> None:
    from puma.runtime import init_ray

    storage.configure(load_config(DEMO).storage)
    print(f"[bench] Ray: {init_ray()}", flush=True)
    for seed in args.seeds:
        for name in [m for m in args.methods if m != ZERO_SHOT]:
            path = result_path(out, name, seed)
            if path.is_file() and "error" not in json.loads(path.read_text()) and not args.force:
                continue
            need_zero_shot = not (out / ZERO_SHOT / "metrics.json").is_file()
            try:
                metrics = run_one(name, seed, out, args, need_zero_shot)
            except Exception as exc:  # noqa: BLE001 - report a failed method in the table, go on
                traceback.print_exc()
                metrics = {"error": f"{type(exc).__name__}: {exc}"}
            if need_zero_shot and "error" not in metrics:
                zero = {k[len("before/"):]: v for k, v in metrics.items() if k.startswith("before/")}
                zero |= {"bench/trainable": 0, COMMIT: metrics[COMMIT]}
                _store(out / ZERO_SHOT / "metrics.json", zero)
            _store(path, metrics)
            harmonic = metrics.get("harmonic/r@1", float("nan"))
            print(f"[bench] {name} seed {seed}: harmonic r@1 {harmonic:.4f}", flush=True)


def _store(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


if __name__ == "__main__":
    raise SystemExit(main())
