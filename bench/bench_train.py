"""Training-step benchmark: PUMA vs full fine-tuning vs a frozen-backbone forward, same batch, same
process, printed as ratios; and samples/s of the whole Ray Train job against the step alone.

    .venv/bin/python bench/bench_train.py                       # offline ViT-S/14 at 112 px, batch 32
    .venv/bin/python bench/bench_train.py --img-size 224 --batch 180 --device cuda   # paper per-GPU batch
    python bench/bench_train.py --config configs/paper_vit_s.yaml --weights none --img-size 224 \
        --batch 180 --record train_gpu        # the paper's ViT-S/16 (random weights: speed only)
    .venv/bin/python bench/bench_train.py --job                 # also the whole job (Ray, data, eval off)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.config import load_config  # noqa: E402
from puma.losses import build_loss  # noqa: E402
from puma.methods import TrainModule, build_model  # noqa: E402
from puma.models.trainable import trainable_parameter_groups  # noqa: E402
from puma.optim import build_optimizer  # noqa: E402
from puma.train.step import autocast_context, train_step  # noqa: E402

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def _timed(fn, repeats: int, device: torch.device) -> tuple[float, float]:
    """Median seconds per call after one warm-up, and peak CUDA memory in GiB (0 on CPU)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return sorted(times)[len(times) // 2], peak


def _overrides(args, method: str) -> list[str]:
    out = [f"model.method={method}", f"model.backbone.img_size={args.img_size}"]
    return out + ([f"model.backbone.weights={args.weights}"] if args.weights else [])


def _step_fn(method: str, args, images, labels, device):
    cfg = load_config(args.config, _overrides(args, method))
    model = build_model(cfg.model).to(device)
    loss = build_loss(cfg.loss, args.classes, cfg.model.head.embed_dim).to(device)
    optimizer = build_optimizer(trainable_parameter_groups(model), loss, cfg.optim)
    module = TrainModule(model, loss).train()
    precision = args.precision if device.type == "cuda" else "fp32"
    return lambda: train_step(module, optimizer, images, labels, 1.0, precision)


def _forward_fn(args, images, device):
    cfg = load_config(args.config, _overrides(args, "linear"))
    model = build_model(cfg.model).to(device).eval()

    precision = args.precision if device.type == "cuda" else "fp32"

    @torch.no_grad()
    def run():
        with autocast_context(device, precision):  # the same precision as the steps
            model.forward_features(images)
    return run


def bench_steps(args) -> dict[str, float]:
    """Median step time of each variant on one fixed batch; prints images/s and ratios."""
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=gen).to(device)
    labels = (torch.arange(args.batch) % args.classes).to(device)
    # built one at a time, so each peak memory holds only its own model and optimiser state
    variants = {"frozen forward": lambda: _forward_fn(args, images, device),
                "linear step": lambda: _step_fn("linear", args, images, labels, device),
                "puma step": lambda: _step_fn("puma", args, images, labels, device),
                "full fine-tune step": lambda: _step_fn("full_finetune", args, images, labels, device)}
    results, rows = {}, []
    print(f"device {device}, batch {args.batch}, {args.img_size} px, {torch.get_num_threads()} threads")
    for name, make in variants.items():
        fn = make()
        seconds, peak = _timed(fn, args.repeats, device)
        results[name] = seconds
        rows.append({"variant": name, "images_per_s": args.batch / seconds, "seconds": seconds,
                     "peak_gib": peak})
        print(f"{name:<22} {args.batch / seconds:8.1f} img/s  peak {peak:6.2f} GiB")
        del fn
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results["frozen forward"]
    for row in rows:
        row["time_vs_frozen_forward"] = row["seconds"] / base
    print(f"ratios (time / frozen forward): puma {results['puma step'] / base:.2f}x, "
          f"full fine-tune {results['full fine-tune step'] / base:.2f}x; "
          f"puma / full fine-tune {results['puma step'] / results['full fine-tune step']:.2f}x")
    if args.record:
        _record(args, rows)
    return results


def _record(args, rows: list[dict]) -> None:
    """bench/results/<args.record>.{json,md} through bench/record.py."""
    from bench.record import record

    table = ["| variant | images/s | time / frozen forward | peak GPU memory (GiB) |", "|---|---|---|---|"]
    table += [f"| {r['variant']} | {r['images_per_s']:.1f} | {r['time_vs_frozen_forward']:.2f}x | "
              f"{r['peak_gib']:.2f} |" for r in rows]
    settings = {"config": Path(args.config).name, "weights": args.weights or "from config",
                "img_size": args.img_size, "batch": args.batch, "precision": args.precision,
                "repeats": args.repeats, "classes": args.classes}
    text = ", ".join(f"{k} {v}" for k, v in settings.items())
    record(args.record, {"settings": settings, "rows": rows}, f"Settings: {text}.\n\n" + "\n".join(table),
           title="Training step: frozen forward, linear, PUMA, full fine-tuning")


def bench_job(args, step_seconds: float) -> None:
    """The whole training job's samples/s (Ray Data + Ray Train) against the bare PUMA step."""
    from puma.runtime import init_ray
    from puma.train.driver import run_training

    init_ray()
    cfg = load_config(args.config, [f"model.backbone.img_size={args.img_size}", "train.epochs=1",
                                    "train.eval_every=0", f"train.batch_size={args.batch}",
                                    f"train.max_steps_per_epoch={args.job_steps}",
                                    "train.run_name=bench-train", "train.storage_path=/tmp/puma-bench-runs"])
    outcome = run_training(cfg)
    job = outcome.metrics["train/samples_per_s"]
    step = args.batch / step_seconds
    print(f"whole job {job:.1f} samples/s vs bare step {step:.1f}: job/step {job / step:.2f}x "
          f"(input pipeline and reporting overhead {100 * (1 - job / step):.0f}%)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEMO))
    parser.add_argument("--img-size", type=int, default=112)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--job", action="store_true", help="also time the whole Ray Train job")
    parser.add_argument("--job-steps", type=int, default=6)
    parser.add_argument("--weights", default="", help="model.backbone.weights override (none: random)")
    parser.add_argument("--record", default="", help="write bench/results/<NAME>.{json,md}")
    args = parser.parse_args(argv)
    results = bench_steps(args)
    if args.job:
        bench_job(args, results["puma step"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
