"""Data pipeline throughput (rows/s), measured side by side in one run:

  1. Ray Data pipeline reading prepared Parquet from local disk,
  2. the same pipeline reading it from a real S3 server (SeaweedFS, started here unless
     --s3-endpoint is given),
  3. a plain PyTorch DataLoader over the same image files on local disk, with the same decode and
     views (puma.data.images), as the baseline.

Each is run for the eval view (decode, resize, center crop) and the train view (per-epoch shuffle,
RandomResizedCrop, flip); every pass consumes every row in batches. Usage:
  python bench/bench_data.py [--images 2000] [--img-size 224] [--epochs 2] [--workers N] [key=value ...]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from puma import storage  # noqa: E402
from puma.config import StorageConfig, load_config  # noqa: E402
from puma.data.images import ViewSpec, make_view  # noqa: E402
from puma.data.prepare import prepare  # noqa: E402
from puma.data.sources import SourceSpec, convert  # noqa: E402

MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
CUB = REPO.parent / "shared" / "data" / "cub200-subset" / "CUB_200_2011"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(CUB), help="a CUB_200_2011-layout release")
    parser.add_argument("--images", type=int, default=2000, help="images to use (first of each class)")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=2, help="passes per setting (the best is reported)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="DataLoader workers")
    parser.add_argument("--s3-endpoint", default="", help="S3 endpoint to use (default: start SeaweedFS)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides for the Ray pipeline, e.g. data.num_decode_cpus=1")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- S3 server


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


def start_seaweedfs(data_dir: Path) -> tuple[subprocess.Popen, str]:
    """``weed mini`` on loopback, credentials from this process's environment; returns (process, endpoint)."""
    weed = Path(sys.executable).parent / "weed"
    ports = {name: _free_port() for name in ("s3", "master", "volume", "filer", "admin")}
    cmd = [str(weed if weed.exists() else shutil.which("weed")), "mini", f"-dir={data_dir}", "-ip=127.0.0.1",
           "-ip.bind=127.0.0.1", "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
           "-s3.port.iceberg=0", "-s3.port.lance=0"]
    for name, port in ports.items():
        cmd += [f"-{name}.port={port}", f"-{name}.port.grpc={port + 10000}"]
    log = open(data_dir / "weed.log", "wb")  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=data_dir)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    storage.configure(StorageConfig(endpoint_url=endpoint))
    for _ in range(240):
        try:
            storage.boto3_client().list_buckets()
            return process, endpoint
        except Exception:  # noqa: BLE001 - not ready yet
            time.sleep(0.25)
    process.terminate()
    raise RuntimeError(f"SeaweedFS did not start; see {data_dir / 'weed.log'}")


# ----------------------------------------------------------------------------- measurements


def time_passes(make_batches, epochs: int) -> tuple[float, float, int]:
    """(first-pass rows/s, best rows/s, rows) over ``epochs`` full passes."""
    rates, rows = [], 0
    for _ in range(epochs):
        start, rows = time.perf_counter(), 0
        for batch in make_batches():
            rows += len(batch["label"])
        rates.append(rows / (time.perf_counter() - start))
    return rates[0], max(rates), rows


def ray_setting(cfg, manifest, train: bool, epochs: int):
    from puma.data import pipeline

    if train:  # the training split, shuffled and augmented
        ds = pipeline.train_dataset(cfg, manifest, pipeline.global_label_map(manifest), MEAN, STD)
    else:  # every row, eval view
        ds = pipeline.eval_dataset(cfg, manifest, "test", MEAN, STD).union(
            pipeline.eval_dataset(cfg, manifest, "train", MEAN, STD))
    return time_passes(lambda: ds.iter_batches(batch_size=cfg.train.batch_size, batch_format="numpy"), epochs)


class FileDataset:
    """A torch map-style dataset over (path, label): the plain-PyTorch baseline."""

    def __init__(self, items, view: ViewSpec) -> None:
        self.items, self.view = items, view

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        import numpy as np

        path, label = self.items[index]
        rng = np.random.default_rng() if self.view.train else None
        with open(path, "rb") as f:
            return {"image": make_view(f.read(), self.view, rng), "label": label}


def torch_setting(items, img_size: int, train: bool, args) -> tuple[float, float, int]:
    from torch.utils.data import DataLoader

    dataset = FileDataset(items, ViewSpec(img_size, MEAN, STD, train=train))
    loader = DataLoader(dataset, batch_size=args.batch_size,
                        shuffle=train, num_workers=args.workers, persistent_workers=args.workers > 0)
    return time_passes(lambda: iter(loader), args.epochs)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Prepare once locally and once on S3, then time the three readers for both views."""
    args = parse_args(argv)
    from puma.runtime import init_ray

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench-access-key")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret-key")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    work = Path(tempfile.mkdtemp(prefix="puma-bench-"))
    server = None
    try:
        if args.s3_endpoint:
            storage.configure(StorageConfig(endpoint_url=args.s3_endpoint))
        else:
            (work / "s3").mkdir()
            server, _ = start_seaweedfs(work / "s3")
        print(f"[bench] Ray: {init_ray()}", flush=True)
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
        return run(args, work)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=15)
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    per_class = max(2, math.ceil(args.images / 100))
    spec = SourceSpec("cub", "cub", args.source, max_per_class=per_class)
    listing = convert(spec)
    items = {view: [(i.source_path, i.label) for i in listing.items if view == "eval" or i.split == "train"]
             for view in ("eval", "train")}  # the rows each Ray setting streams
    results: dict[str, tuple[float, float, int]] = {}
    manifests = {}
    for where, uri in (("local", str(work / "prepared")), ("s3", "s3://puma-bench/prepared")):
        storage.ensure_bucket(uri)
        start = time.perf_counter()
        manifests[where] = prepare([spec], uri, shard_rows=500, log=lambda _: None).manifest
        elapsed = time.perf_counter() - start
        print(f"[bench] prepare -> {where}: {len(items['eval'])} images in {elapsed:.1f}s", flush=True)
    for train in (False, True):
        view = "train" if train else "eval"
        for where, manifest in manifests.items():
            cfg = load_config(None, [f"data.uri={manifest.uri}", f"model.backbone.img_size={args.img_size}",
                                     f"train.batch_size={args.batch_size}",
                                     f"data.rejects_uri={work / 'rejects.jsonl'}", *args.overrides])
            results[f"ray-{where}/{view}"] = ray_setting(cfg, manifest, train, args.epochs)
            print(f"[bench] ray-{where}/{view}: {results[f'ray-{where}/{view}']}", flush=True)
        results[f"torch-local/{view}"] = torch_setting(items[view], args.img_size, train, args)
        print(f"[bench] torch-local/{view}: {results[f'torch-local/{view}']}", flush=True)
    print_table(results, args)
    return 0


def print_table(results: dict[str, tuple[float, float, int]], args: argparse.Namespace) -> None:
    print(f"\n{args.images} CUB images at {args.img_size}px, batch {args.batch_size}, "
          f"{args.epochs} passes each, Ray overrides {args.overrides or 'none'}, "
          f"{os.cpu_count()} cores; DataLoader workers {args.workers}")
    print(f"{'setting':<22}{'rows':>7}{'first rows/s':>14}{'best rows/s':>13}")
    for name, (first, best, rows) in results.items():
        print(f"{name:<22}{rows:>7}{first:>14.1f}{best:>13.1f}")
    for view in ("eval", "train"):
        local, s3, torch_ = (results[f"{k}/{view}"][1] for k in ("ray-local", "ray-s3", "torch-local"))
        print(f"{view}: ray-local / torch-local = {local / torch_:.2f}x, "
              f"ray-s3 / ray-local = {s3 / local:.2f}x, "
              f"ray-s3 / torch-local = {s3 / torch_:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
