"""Method comparison on the embedded default's multi-domain sample data, same budget for every method.

Trains each method through the same code path as ``jobs/train.py`` (Ray Train, the demo's data,
offline DINOv2 ViT-S/14 at the demo's image size), each with the same number of epochs, steps and
batch size, evaluates once at the end, and prints per-dataset, unified and harmonic R@1 side by
side. Zero-shot is the frozen backbone's own features (the runs' shared 'before' evaluation).

    .venv/bin/python bench/bench_methods.py                          # every method, default budget
    .venv/bin/python bench/bench_methods.py --methods linear puma --steps 40
    .venv/bin/python bench/bench_methods.py --table-only              # print the stored results

Each method's metrics are stored as ``<out>/<budget>/<method>.json`` as soon as it finishes, so an
interrupted comparison continues where it stopped and methods can be added later under the same
budget (``--force`` re-trains). A method whose config does not build (e.g. not implemented in this
checkout) is reported as such, never silently left out.

Per-method settings: ``configs/methods/<method>.yaml`` when it exists (its model section without
the backbone, its loss, its optimiser group multipliers ``optim.*_lr_mult`` and any method
sections, layered over configs/demo.yaml), else the overrides below.
Every method uses the demo's base learning rate (2e-5) except full fine-tuning, which keeps the
paper's ratio between full fine-tuning and parameter-efficient rates (3e-5 / 1e-4 = 0.3).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from puma import storage  # noqa: E402
from puma.config import ConfigError, load_config  # noqa: E402

DEMO = ROOT / "configs" / "demo.yaml"
METHOD_CONFIGS = ROOT / "configs" / "methods"
FULL_FT_LR_RATIO = 0.3  # paper appendix A: 3e-5 for full fine-tuning against 1e-4
ZERO_SHOT = "zero_shot"
# method name in the table -> model.method (and extra overrides)
METHODS: dict[str, list[str]] = {
    ZERO_SHOT: [],
    "linear": ["model.method=linear"],
    "static_adapter": ["model.method=adaptformer"],
    "full_finetune": ["model.method=full_finetune"],
    "vptsp_g": ["model.method=vptsp_g"],
    "udml_ss": ["model.method=udml_ss"],
    "puma": ["model.method=puma"],
}
KEEP_FROM_METHOD_FILE = ("model", "loss")  # plus any section the demo does not set for training
DEMO_OWNED = ("data", "train", "storage", "eval", "index", "sweep", "optim", "embed")


def method_layer(name: str) -> dict:
    """The method's settings from configs/methods/<name>.yaml (model without backbone, loss, ...)."""
    path = METHOD_CONFIGS / f"{name}.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    layer = {k: v for k, v in data.items() if k not in DEMO_OWNED}
    if isinstance(layer.get("model"), dict):
        layer["model"] = {k: v for k, v in layer["model"].items() if k != "backbone"}
    mults = {k: v for k, v in (data.get("optim") or {}).items() if k.endswith("_lr_mult")}
    if mults:  # the method's own ratios between its groups; the base rate and schedule are the budget's
        layer["optim"] = mults
    return layer


def method_config(name: str, args: argparse.Namespace, budget_dir: str):
    """demo.yaml <- method file <- method overrides <- the shared budget."""
    demo = yaml.safe_load(DEMO.read_text())
    cfg = load_config(DEMO, None)
    lr = cfg.optim.lr * (FULL_FT_LR_RATIO if name == "full_finetune" else 1.0)
    budget = [f"train.epochs={args.epochs}", f"train.max_steps_per_epoch={args.steps}",
              f"train.batch_size={args.batch}", f"train.eval_every={args.epochs}",
              f"train.seed={args.seed}", f"train.run_name=bench-{name}", f"train.storage_path={budget_dir}",
              f"optim.lr={lr}", f"model.backbone.img_size={args.img_size}"]
    layered = _merge(demo, method_layer(name))
    tmp = Path(budget_dir) / f"{name}.config.yaml"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(yaml.safe_dump(layered))
    return load_config(tmp, METHODS[name] + budget)


def _merge(base: dict, layer: dict) -> dict:
    out = dict(base)
    for key, value in layer.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if nested else value
    return out


def run_method(name: str, args: argparse.Namespace, budget_dir: str, need_zero_shot: bool) -> dict:
    """Train one method under the budget; returns its final metrics (plus before/ when evaluated)."""
    from puma.methods import METHODS as BUILT
    from puma.train.driver import run_training

    cfg = method_config(name, args, budget_dir)
    if cfg.model.method not in BUILT:
        raise ConfigError(f"model.method={cfg.model.method!r} is not built in this checkout; "
                          f"known: {sorted(BUILT)}")
    cfg.train.eval_before = need_zero_shot
    start = time.perf_counter()
    outcome = run_training(cfg)
    metrics = {k: float(v) for k, v in outcome.metrics.items() if isinstance(v, (int, float))}
    metrics["bench/seconds"] = time.perf_counter() - start
    return metrics


def budget_name(args: argparse.Namespace) -> str:
    return f"e{args.epochs}-s{args.steps}-b{args.batch}-px{args.img_size}-seed{args.seed}"


def load_results(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def table(results: dict[str, dict], key: str = "r@1") -> str:
    """Rows: datasets, unified, harmonic; columns: methods in METHODS order."""
    cols = [m for m in METHODS if m in results]
    found = {k.split("/")[0] for r in results.values() for k in r
             if k.endswith(f"/{key}") and k.count("/") == 1}
    names = sorted(found - {"unified", "harmonic", "best", "before"})
    lines = [f"| {key} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for row in [*names, "unified", "harmonic"]:
        cells = [_cell(results[m], f"{row}/{key}") for m in cols]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    seconds = [_cell(results[m], "bench/seconds", "{:.0f}") for m in cols]
    lines.append("| seconds | " + " | ".join(seconds) + " |")
    return "\n".join(lines)


def _cell(result: dict, key: str, fmt: str = "{:.4f}") -> str:
    if "error" in result:
        return "n/a"
    value = result.get(key)
    return "-" if value is None else fmt.format(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="training steps per epoch")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--img-size", type=int, default=112)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench" / "methods"))
    parser.add_argument("--force", action="store_true", help="re-train methods that have results")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args(argv)
    folder = Path(args.out) / budget_name(args)
    folder.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        _run_all(args, folder)
    results = load_results(folder)
    text = table(results)
    print(f"\nsame budget for every method: {budget_name(args)} (epochs-steps-batch-image size-seed)")
    print(text)
    (folder / "table.md").write_text(text + "\n")
    for name, result in results.items():
        if "error" in result:
            print(f"{name}: not run: {result['error']}")
    print(f"[bench] results: {folder}")
    return 0


def _run_all(args: argparse.Namespace, folder: Path) -> None:
    from puma.runtime import init_ray

    storage.configure(load_config(DEMO).storage)
    print(f"[bench] Ray: {init_ray()}", flush=True)
    done = load_results(folder)
    for name in [m for m in args.methods if m != ZERO_SHOT]:
        if name in done and "error" not in done[name] and not args.force:
            print(f"[bench] {name}: stored result kept (--force re-trains)")
            continue
        need_zero_shot = ZERO_SHOT not in done
        if args.force:  # else a stale, unfinished run of this budget resumes where it stopped
            storage.delete(str(folder / "runs" / f"bench-{name}"))
        try:
            metrics = run_method(name, args, str(folder / "runs"), need_zero_shot)
        except ConfigError as exc:  # the method is not available in this checkout
            metrics = {"error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - report a failed method in the table, go on
            traceback.print_exc()
            metrics = {"error": f"{type(exc).__name__}: {exc}"}
        if need_zero_shot and "error" not in metrics:
            zero = {k[len("before/"):]: v for k, v in metrics.items() if k.startswith("before/")}
            (folder / f"{ZERO_SHOT}.json").write_text(json.dumps(zero, indent=1, sort_keys=True))
            done[ZERO_SHOT] = zero
        (folder / f"{name}.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))
        done[name] = metrics
        print(f"[bench] {name}: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())
                                              if isinstance(v, float) and k.endswith("/r@1")
                                              and not k.startswith(("before/", "best/"))), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
