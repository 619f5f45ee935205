"""Training-step benchmark: PUMA vs full fine-tuning vs a frozen-backbone forward, same batch, same
process, printed as ratios; and samples/s of the whole Ray Train job against the step alone.

    .venv/bin/python bench/bench_train.py                       # offline ViT-S/14 at 112 px, batch 32
    .venv/bin/python bench/bench_train.py --img-size 224 --batch 180 --device cuda   # paper per-GPU batch
    python bench/bench_train.py --config configs/paper_vit_s.yaml --weights none --img-size 224 \
        --batch 180 --record train_gpu        # the paper's ViT-S/16 (random weights: speed only)
    .venv/bin/python bench/bench_train.py --job                 # also the whole job (Ray, data, eval off)
    python bench/bench_train.py ... --compile --profile         # + torch.compile'd steps, a profile of PUMA's

--compile adds "puma step (compiled)" and "full fine-tune step (compiled)": the train module's model
compiled in place (nn.Module.compile, default mode; the loss stays eager, see _step_fn), so train_step
still finds its after_backward hook; the warm-up step includes the compilation, its seconds recorded.
--profile runs torch.profiler (CPU, and CUDA on a GPU) over 3 PUMA steps after the warm-up: the top
ops by self device time and the CPU and device time of a step. On CUDA (bf16), "puma step (bf16
frozen weights)" keeps the frozen weights in bf16, so autocast does not cast them again at every step.
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys
import time
import traceback
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


class Stopped(Exception):
    """SIGTERM (e.g. from `timeout`): stop measuring and record what was measured so far."""


_STOPPED: list[int] = []  # the signal, also where a library caught and wrapped the Stopped raised


def _stop(signum, frame):
    _STOPPED.append(signum)
    raise Stopped(f"signal {signum}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, repeats: int, device: torch.device) -> tuple[float, float, float]:
    """Median seconds per call after one warm-up, peak CUDA memory in GiB (0 on CPU), and the
    seconds of the warm-up call (a compiled variant's compilation included)."""
    start = time.perf_counter()
    fn()
    _sync(device)
    warmup = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return sorted(times)[len(times) // 2], peak, warmup


def _overrides(args, method: str) -> list[str]:
    out = [f"model.method={method}", f"model.backbone.img_size={args.img_size}"]
    return out + ([f"model.backbone.weights={args.weights}"] if args.weights else [])


def _step_fn(method: str, args, images, labels, device, compiled: bool = False, frozen_bf16: bool = False):
    cfg = load_config(args.config, _overrides(args, method))
    model = build_model(cfg.model).to(device)
    loss = build_loss(cfg.loss, args.classes, cfg.model.head.embed_dim).to(device)
    optimizer = build_optimizer(trainable_parameter_groups(model), loss, cfg.optim)
    module = TrainModule(model, loss).train()
    if frozen_bf16:  # the frozen weights stored in bf16: autocast no longer casts them at every step
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    if compiled:  # the model (backbone, adapters, prompts, head) compiled in place, the loss left eager:
        # CurricularFace updates its per-class t buffer in place after the logits read it, which a compiled
        # graph that saved t for backward refuses ("modified by an inplace operation", batch 180, 100
        # classes); module stays a TrainModule, so train_step still finds module.after_backward (DDP too)
        model.compile()
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


def _device_time(event) -> float:
    """An averaged profiler event's self time on the device in us (named cuda before torch 2.4)."""
    value = getattr(event, "self_device_time_total", None)
    return float(value if value is not None else getattr(event, "self_cuda_time_total", 0.0))


def _profile(fn, device: torch.device, steps: int = 3, rows: int = 15) -> dict:
    """torch.profiler over ``steps`` calls of a warmed-up ``fn``: the top ``rows`` ops by self device
    time (self CPU time on a CPU) and the wall, CPU-op and device time of one step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    table = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows)
    cpu_us = sum(e.self_cpu_time_total for e in events) / steps
    # as the table's footer counts it: the kernels' and copies' own events, not the ops that launched them
    device_us = sum(_device_time(e) for e in events
                    if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU
                    and not getattr(e, "is_user_annotation", False)) / steps
    summary = {"steps": steps, "wall_ms_per_step": 1e3 * wall, "cpu_ops_ms_per_step": cpu_us / 1e3,
               "device_ms_per_step": device_us / 1e3, "table": table}
    print(f"profile of the puma step ({steps} steps after the warm-up; top {rows} ops by self "
          f"{'CUDA' if cuda else 'CPU'} time):\n{table}")
    print(f"per step: wall {summary['wall_ms_per_step']:.1f} ms, CPU time in ops "
          f"{summary['cpu_ops_ms_per_step']:.1f} ms, device time {summary['device_ms_per_step']:.1f} ms"
          + (f" (device busy {100 * device_us / 1e3 / summary['wall_ms_per_step']:.0f}% of the wall time)"
             if cuda else " (no device)"))
    return summary


def _profile_or_error(fn, device: torch.device, errors: dict[str, str]) -> dict:
    """_profile, or {} with the error noted: a profiler failure must not cost the step's timing."""
    try:
        return _profile(fn, device)
    except Stopped:
        raise
    except Exception as exc:
        if _STOPPED:
            raise Stopped(f"signal {_STOPPED[0]}") from exc
        traceback.print_exc()
        errors["profile"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        return {}


def _variants(args, images, labels, device) -> dict:
    """Name -> builder of the step to time; built one at a time, so each peak memory holds only its
    own model and optimiser state."""
    variants = {"frozen forward": lambda: _forward_fn(args, images, device),
                "linear step": lambda: _step_fn("linear", args, images, labels, device),
                "puma step": lambda: _step_fn("puma", args, images, labels, device),
                "full fine-tune step": lambda: _step_fn("full_finetune", args, images, labels, device)}
    if device.type == "cuda" and args.precision == "bf16":
        variants["puma step (bf16 frozen weights)"] = lambda: _step_fn("puma", args, images, labels, device,
                                                                       frozen_bf16=True)
    if args.compile:
        variants["puma step (compiled)"] = lambda: _step_fn("puma", args, images, labels, device,
                                                            compiled=True)
        variants["full fine-tune step (compiled)"] = lambda: _step_fn("full_finetune", args, images, labels,
                                                                      device, compiled=True)
    return variants


def _ratios(results: dict[str, float]) -> dict[str, float]:
    """Time ratios between the steps that were measured (a ratio below 1: the first is faster)."""
    pairs = {"puma / full fine-tune (eager)": ("puma step", "full fine-tune step"),
             "puma compiled / full fine-tune compiled": ("puma step (compiled)",
                                                         "full fine-tune step (compiled)"),
             "puma compiled / full fine-tune eager": ("puma step (compiled)", "full fine-tune step"),
             "puma compiled / puma eager": ("puma step (compiled)", "puma step"),
             "puma bf16 frozen weights / puma": ("puma step (bf16 frozen weights)", "puma step")}
    return {k: results[a] / results[b] for k, (a, b) in pairs.items() if a in results and b in results}


def bench_steps(args) -> dict[str, float]:
    """Median step time of each variant on one fixed batch; prints images/s and ratios."""
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=gen).to(device)
    labels = (torch.arange(args.batch) % args.classes).to(device)
    results, rows, errors, profiled = {}, [], {}, {}
    print(f"device {device}, batch {args.batch}, {args.img_size} px, {torch.get_num_threads()} threads",
          flush=True)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        for name, make in _variants(args, images, labels, device).items():
            try:
                fn = make()
                seconds, peak, warmup = _timed(fn, args.repeats, device)
                if name == "puma step" and args.profile:
                    profiled = _profile_or_error(fn, device, errors)
            except Stopped:
                raise
            except Exception as exc:  # one variant failing (e.g. a compiler error) must not end the run
                if _STOPPED:  # the Stopped came back wrapped (torch.compile wraps its callees' errors)
                    raise Stopped(f"signal {_STOPPED[0]}") from exc
                traceback.print_exc()
                first = (str(exc).strip().splitlines() or [""])[0]
                errors[name] = f"{type(exc).__name__}: {first}"
                print(f"{name:<32} failed: {errors[name]}", flush=True)
                continue
            finally:
                fn = None
                gc.collect()
                if "compiled" in name:
                    torch._dynamo.reset()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            results[name] = seconds
            rows.append({"variant": name, "images_per_s": args.batch / seconds, "seconds": seconds,
                         "peak_gib": peak, "warmup_s": warmup})
            print(f"{name:<32} {args.batch / seconds:8.1f} img/s  peak {peak:6.2f} GiB  "
                  f"warm-up {warmup:6.1f} s{' (compilation included)' if 'compiled' in name else ''}",
                  flush=True)
    except Stopped as exc:
        print(f"stopped ({exc}): recording the {len(rows)} variants measured so far", flush=True)
        errors["stopped"] = str(exc)
    finally:
        signal.signal(signal.SIGTERM, previous)
    base = results.get("frozen forward")
    for row in rows:
        row["time_vs_frozen_forward"] = row["seconds"] / base if base else None
    if base and "puma step" in results and "full fine-tune step" in results:
        print(f"ratios (time / frozen forward): puma {results['puma step'] / base:.2f}x, "
              f"full fine-tune {results['full fine-tune step'] / base:.2f}x")
    ratios = _ratios(results)
    if ratios:
        print("time ratios: " + "; ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if args.record:
        _record(args, rows, ratios, profiled, errors)
    return results


def _record(args, rows: list[dict], ratios: dict[str, float], profiled: dict, errors: dict[str, str]) -> None:
    """bench/results/<args.record>.{json,md} through bench/record.py."""
    from bench.record import record

    table = ["| variant | images/s | time / frozen forward | peak GPU memory (GiB) | warm-up (s) |",
             "|---|---|---|---|---|"]
    table += [f"| {r['variant']} | {r['images_per_s']:.1f} | "
              + (f"{r['time_vs_frozen_forward']:.2f}x" if r["time_vs_frozen_forward"] else "-")
              + f" | {r['peak_gib']:.2f} | {r['warmup_s']:.1f} |" for r in rows]
    settings = {"config": Path(args.config).name, "weights": args.weights or "from config",
                "img_size": args.img_size, "batch": args.batch, "precision": args.precision,
                "repeats": args.repeats, "classes": args.classes, "compile": args.compile,
                "profile": args.profile}
    text = ", ".join(f"{k} {v}" for k, v in settings.items())
    markdown = f"Settings: {text}.\n\n" + "\n".join(table)
    if ratios:
        markdown += "\n\nTime ratios (below 1: the first is faster): " + "; ".join(
            f"{k} {v:.2f}x" for k, v in ratios.items()) + "."
    if any("compiled" in r["variant"] for r in rows):
        markdown += ("\n\nCompiled: the train module's model (backbone, adapters, prompts, head) under "
                     "torch.compile (default mode), the loss eager; the warm-up step includes the "
                     "compilation.")
    if errors:
        markdown += "\n\nNot measured: " + "; ".join(f"{k}: {v}" for k, v in errors.items()) + "."
    if profiled:
        markdown += (f"\n\nProfile of the PUMA step (torch.profiler, {profiled['steps']} steps after the "
                     f"warm-up): per step, wall {profiled['wall_ms_per_step']:.1f} ms, CPU time in ops "
                     f"{profiled['cpu_ops_ms_per_step']:.1f} ms, device time "
                     f"{profiled['device_ms_per_step']:.1f} ms.\n\n```\n{profiled['table'].rstrip()}\n```")
    record(args.record, {"settings": settings, "rows": rows, "ratios": ratios, "profile": profiled,
                         "errors": errors}, markdown,
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
    parser.add_argument("--compile", action="store_true",
                        help="also time the PUMA and full fine-tuning steps under torch.compile")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler over 3 PUMA steps: top ops, CPU vs device time per step")
    args = parser.parse_args(argv)
    results = bench_steps(args)
    if args.job:
        bench_job(args, results["puma step"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
