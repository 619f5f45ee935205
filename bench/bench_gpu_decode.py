"""How many CPU cores one GPU's training needs at 224 px: decoding in Ray Data tasks vs on the GPU.

For each photo set (``cub``: the CUB sample as it is; ``large``: the same photos resized up to a longer
side of 800-1,200 px, JPEG q90, as SOP, In-Shop and NABirds photos are) and each view (eval, train):

  tasks   data.decode_on=tasks: the task decodes with PIL (draft decoding on), crops and normalises;
          rows per CPU-second of one process (``time.process_time``)
  plan    data.decode_on=worker, the task's share: read the JPEG header, draw the crop, build the
          batch columns; rows per CPU-second
  device  data.decode_on=worker, the worker's share: ``device_views.batch_images`` (nvjpeg decode,
          PIL-weight resampling, normalisation) on --device, rows/s (best of --repeats, synchronised)

With the training step's images/s per GPU (--train-record, bench/bench_train.py's record) it gives
the cores per GPU each mode needs (worker: the task's plan plus the consumer's own CPU time, measured
while it decodes and resamples). ``decode only`` times torchvision's decode_jpeg alone, and
``libjpeg-turbo`` the same call on the CPU, for comparison. It also measures how far the worker-decoded
views are from the tasks' PIL views (draft off), in 8-bit levels: on a CPU they are equal; nvjpeg's
pixels differ from libjpeg-turbo's by a few levels (mean 0.5 on the CUB photos on an H100).

  python bench/bench_gpu_decode.py [--images 512] [--device auto] [--train-record ...] [--record gpu_decode]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.record import RESULTS, record  # noqa: E402
from puma.data.images import ViewSpec, item_rng, make_view, plan_worker_view, worker_columns  # noqa: E402

CUB = REPO.parent / "shared" / "data" / "cub200-subset" / "CUB_200_2011" / "images"
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(CUB), help="a folder of JPEG photos (searched recursively)")
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128, help="rows per device batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto (cuda when present) | cuda | cpu")
    parser.add_argument("--train-record", default=str(RESULTS / "train_gpu.json"))
    parser.add_argument("--record", default="gpu_decode", help="bench/results/<name>.{json,md}; '' to skip")
    return parser.parse_args(argv)


def photo_sets(args: argparse.Namespace, work: Path) -> dict[str, list[bytes]]:
    from PIL import Image

    files = sorted(Path(args.source).rglob("*.jpg"))[: args.images]
    if not files:
        raise SystemExit(f"no .jpg under {args.source}")
    cub = [f.read_bytes() for f in files]
    rng, large = np.random.default_rng(0), []
    for i, f in enumerate(files):
        img = Image.open(f).convert("RGB")
        factor = int(rng.integers(800, 1201)) / max(img.size)
        path = work / f"{i}.jpg"
        img.resize((round(img.width * factor), round(img.height * factor)), Image.Resampling.BICUBIC) \
            .save(path, format="JPEG", quality=90)
        large.append(path.read_bytes())
    return {"cub": cub, "large": large}


def per_cpu_second(fn, datas: list[bytes]) -> tuple[float, list]:
    """(rows per CPU-second of this process, outputs) of fn(i, data) over every row."""
    start = time.process_time()
    out = [fn(i, d) for i, d in enumerate(datas)]
    return len(datas) / max(time.process_time() - start, 1e-9), out


def device_rate(columns: list[dict], device, repeats: int) -> tuple[float, float, list]:
    """(rows/s of batch_images over the batches on ``device``, rows per CPU-second of this process while
    it runs, the last pass's tensors on the CPU)."""
    from puma.data.device_views import batch_images

    batch_images(columns[0], device)  # warm-up: nvjpeg handles, kernels
    _sync(device)
    best, cpu, rows = float("inf"), float("inf"), sum(len(c["encoded"]) for c in columns)
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        outs = [batch_images(c, device) for c in columns]
        _sync(device)
        best, cpu = min(best, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return rows / best, rows / max(cpu, 1e-9), [o.cpu().numpy() for o in outs]


def decode_rate(datas: list[bytes], batch: int, device, repeats: int) -> tuple[float, float]:
    """(rows/s, rows per CPU-second) of the JPEG decode alone (torchvision's decode_jpeg) on ``device``."""
    from puma.data.device_views import decode_jpegs

    chunks = [datas[i:i + batch] for i in range(0, len(datas), batch)]
    decode_jpegs(chunks[0], device)
    _sync(device)
    best, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        for chunk in chunks:
            decode_jpegs(chunk, device)
        _sync(device)
        best, cpu = min(best, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return len(datas) / best, len(datas) / max(cpu, 1e-9)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, datas: list[bytes], train: bool, args, device) -> dict:
    import torch

    spec = ViewSpec(args.img_size, MEAN, STD, train)
    worker = ViewSpec(args.img_size, MEAN, STD, train, on_worker=True)
    rng = (lambda i: item_rng(0, 0, str(i))) if train else (lambda i: None)
    tasks, _ = per_cpu_second(lambda i, d: make_view(d, spec, rng(i)), datas)
    plan, plans = per_cpu_second(lambda i, d: plan_worker_view(d, worker, rng(i)), datas)
    batches = [plans[i:i + args.batch] for i in range(0, len(plans), args.batch)]
    columns = [worker_columns(b, worker) for b in batches]
    on_device, device_cpu, views = device_rate(columns, device, args.repeats)
    decode, decode_cpu = decode_rate(datas, args.batch, device, args.repeats)
    _, libjpeg_cpu = decode_rate(datas, args.batch, torch.device("cpu"), 1)  # torchvision's CPU decoder
    full = ViewSpec(args.img_size, MEAN, STD, train, draft=False)
    reference = np.stack([make_view(d, full, rng(i)) for i, d in enumerate(datas)])
    levels = np.abs(np.concatenate(views) - reference) * np.asarray(STD)[:, None, None] * 255  # 8-bit levels
    return {"photos": name, "view": "train" if train else "eval", "images": len(datas),
            "tasks_rows_per_cpu_s": tasks, "plan_rows_per_cpu_s": plan, "device_rows_per_s": on_device,
            "device_rows_per_cpu_s": device_cpu, "decode_rows_per_s": decode,
            "decode_rows_per_cpu_s": decode_cpu, "libjpeg_rows_per_cpu_s": libjpeg_cpu,
            "jpeg_rows": sum(p.data == d for p, d in zip(plans, datas, strict=True)),
            "mean_abs_levels": float(levels.mean()), "p99_abs_levels": float(np.percentile(levels, 99))}


def train_rate(path: str) -> tuple[float, str]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return 0.0, ""
    rows = [r for r in data.get("rows", []) if r.get("variant") == "puma step"]
    device = data.get("environment", {}).get("device", {})
    name = ", ".join(device.get("names", [])) if isinstance(device, dict) else str(device)
    return (float(rows[0]["images_per_s"]), f"{name}, {Path(path).name}") if rows else (0.0, "")


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    torch.set_num_threads(1)
    per_gpu, train_device = train_rate(args.train_record)
    rows = []
    with tempfile.TemporaryDirectory(prefix="puma-gpu-decode-") as work:
        for name, datas in photo_sets(args, Path(work)).items():
            for train in (False, True):
                row = measure(name, datas, train, args, device)
                if per_gpu:
                    row["cores_per_gpu_tasks"] = per_gpu / row["tasks_rows_per_cpu_s"]
                    row["cores_per_gpu_worker"] = (per_gpu / row["plan_rows_per_cpu_s"]
                                                   + per_gpu / row["device_rows_per_cpu_s"])
                rows.append(row)
                print(json.dumps(row), flush=True)
    head = (f"decode on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}); "
            f"training step {per_gpu:,.0f} img/s per GPU ({train_device or 'no record'})")
    table = ["| photos | view | tasks rows/CPU-s | plan rows/CPU-s | worker rows/s | worker rows/CPU-s | "
             "decode only rows/s | decode only rows/CPU-s | libjpeg-turbo rows/CPU-s | cores/GPU tasks | "
             "cores/GPU worker | mean / p99 abs diff (levels) |", "|" + "---|" * 12]
    for r in rows:
        table.append(f"| {r['photos']} | {r['view']} | {r['tasks_rows_per_cpu_s']:,.0f} | "
                     f"{r['plan_rows_per_cpu_s']:,.0f} | {r['device_rows_per_s']:,.0f} | "
                     f"{r['device_rows_per_cpu_s']:,.0f} | {r['decode_rows_per_s']:,.0f} | "
                     f"{r['decode_rows_per_cpu_s']:,.0f} | {r['libjpeg_rows_per_cpu_s']:,.0f} | "
                     f"{r.get('cores_per_gpu_tasks', float('nan')):.1f} | "
                     f"{r.get('cores_per_gpu_worker', float('nan')):.1f} | "
                     f"{r['mean_abs_levels']:.3f} / {r['p99_abs_levels']:.1f} |")
    print(head)
    print("\n".join(table))
    if args.record:
        record(args.record, {"rows": rows, "device": str(device), "train_images_per_s": per_gpu,
                             "train_device": train_device},
               "\n".join([head, "", *table]), title="Decoding on the GPU (data.decode_on=worker) vs in tasks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
