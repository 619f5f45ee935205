"""Data pipeline throughput per CPU core, Ray Data beside a PyTorch DataLoader, measured in one run.

For each photo set (``cub``: the CUB sample as it is, 227-500 px; ``large``: the same photos resized up to
a longer side of 800-1,200 px, as SOP, In-Shop and NABirds photos are) and each view (eval: decode,
resize, center crop; train: per-epoch shuffle, RandomResizedCrop, flip), every pass consumes every row
in batches of --batch-size:

  ray-local      the Ray Data pipeline (puma.data.pipeline) over Parquet shards on local disk
  ray-s3         the same over a real S3 server (SeaweedFS, started here unless --s3-endpoint is given)
  torch-local    a DataLoader over the same image files with the same decode and views (puma.data.images),
                 --workers processes (default: every core, as Ray Data gets)
  torch-s3       the same DataLoader over the same photos on the same S3 server, one object per photo read
                 with boto3's get_object (a client per worker), as a PyTorch user reads S3
and, on the large photos,
  ray-local-full     ray-local with data.jpeg_draft=false (every JPEG decoded at full size)
  ray-local-shrunk   ray-local over shards prepared with data.prepare_max_side (--max-side)
  torch-local-full   torch-local without draft decoding

Per core: the machine's busy CPU time during a pass is read from /proc/stat (every process: Ray's
workers, raylet and object store, the DataLoader's workers, the driver), so rows per busy core-second
is what each pipeline costs, whatever its parallelism; rows/s is the wall-clock rate. Each setting's
ratios are over the DataLoader reading from the same storage (torch-s3 for ray-s3, torch-local for the
rest): on S3 both pay the server's CPU (SeaweedFS runs on this machine), so ray-s3 against torch-local
(also given) counts the server's work against Ray Data alone. The best of --epochs passes is
a setting's figure in a round, after an untimed pass of each view through Ray and through each
DataLoader (without it the first Ray setting also paid for the worker processes' start: 0.53x
against S3's 0.85x on the same photos).
Every Ray pass is a new execution of the Dataset, as every epoch is, and pays its start-up once (the
executor, its operators' serialised transforms, the shuffle's barrier: about 0.3 CPU-seconds here);
the DataLoader keeps its workers between passes (persistent_workers). 4,000 photos per set (2,000
rows per training pass: the training split) keep that start-up a few per cent of a pass; at 1,000
it was about 10-30% of a Ray pass, more than a real epoch of the eight datasets ever pays.
Rounds (--rounds): every setting of a photo set and view runs once per round, in the reverse order
on every other round, and each round's ratios are over that round's DataLoader; the table gives the
median of the rounds' figures and the range of the ratios. This machine drifts by 10-15% between
passes minutes apart (the same DataLoader pass: 97 and 113 rows per core-second), more than the
differences it is asked to show, so a single round cannot tell 0.98x from 1.05x.
With --train-record (bench/results/train_gpu.json by default), the table
also gives how many cores at that rate feed one GPU's training step.

  python bench/bench_data.py [--images 4000] [--img-size 224] [--epochs 2] [--rounds 3] [--sets cub large]
                             [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.record import RESULTS, record  # noqa: E402
from puma import storage  # noqa: E402
from puma.config import StorageConfig, load_config  # noqa: E402
from puma.data.images import ViewSpec, make_view  # noqa: E402
from puma.data.prepare import prepare  # noqa: E402
from puma.data.sources import SourceSpec, convert  # noqa: E402

MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
CUB = REPO.parent / "shared" / "data" / "cub200-subset" / "CUB_200_2011"
BUCKET = "puma-bench"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(CUB), help="a CUB_200_2011-layout release")
    parser.add_argument("--images", type=int, default=4000,
                        help="images per set (the first of each class); a pass is one epoch of them")
    parser.add_argument("--sets", nargs="+", default=["cub", "large"], choices=["cub", "large"])
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--max-side", type=int, default=512, help="data.prepare_max_side of ray-local-shrunk")
    parser.add_argument("--epochs", type=int, default=2,
                        help="passes per setting and round (the best counts)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every setting (medians and the ratios' range are reported)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="DataLoader workers")
    parser.add_argument("--s3-endpoint", default="", help="S3 endpoint to use (default: start SeaweedFS)")
    parser.add_argument("--train-record", default=str(RESULTS / "train_gpu.json"),
                        help="bench_train.py's record: images/s of one GPU, for cores per GPU")
    parser.add_argument("--record", default="data", help="bench/results/<name>.{json,md}; '' to skip")
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


def busy_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal; /proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass
class Pass:
    rows: int
    seconds: float
    cpu_seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds

    @property
    def rows_per_core_s(self) -> float:
        return self.rows / max(self.cpu_seconds, 1e-9)

    @property
    def cores(self) -> float:
        return self.cpu_seconds / self.seconds


def time_passes(make_batches, epochs: int) -> Pass:
    """The pass with the most rows per busy core-second among ``epochs`` full passes."""
    passes = []
    for _ in range(epochs):
        rows, cpu0, start = 0, busy_cpu_seconds(), time.perf_counter()
        for batch in make_batches():
            rows += len(batch["label"])
        passes.append(Pass(rows, time.perf_counter() - start, busy_cpu_seconds() - cpu0))
    return max(passes, key=lambda p: p.rows_per_core_s)


def ray_setting(cfg, manifest, train: bool, epochs: int) -> Pass:
    from puma.data import pipeline

    if train:  # the training split, shuffled and augmented
        ds = pipeline.train_dataset(cfg, manifest, pipeline.global_label_map(manifest), MEAN, STD)
    else:  # every row, eval view
        ds = pipeline.eval_dataset(cfg, manifest, "test", MEAN, STD).union(
            pipeline.eval_dataset(cfg, manifest, "train", MEAN, STD))
    from puma.data.device_views import batch_images

    def batches():  # the consumer's normalisation (batch_images) counts, as the DataLoader's workers' does
        for batch in ds.iter_batches(batch_size=cfg.train.batch_size, batch_format="numpy"):
            batch_images(batch, "cpu")
            yield batch

    return time_passes(batches, epochs)


class FileDataset:
    """A torch map-style dataset over (path, label): the plain-PyTorch baseline."""

    def __init__(self, items, view: ViewSpec) -> None:
        self.items, self.view = items, view

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        path, label = self.items[index]
        rng = np.random.default_rng() if self.view.train else None
        return {"image": make_view(self.read(path), self.view, rng), "label": label}

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()


class S3FileDataset(FileDataset):
    """The same over one S3 object per photo (items: (key, label)), each read with boto3's get_object,
    as a PyTorch user reads S3; one client per DataLoader worker process, made in it."""

    def __init__(self, items, view: ViewSpec, bucket: str) -> None:
        super().__init__(items, view)
        self.bucket, self.settings, self._client, self._pid = bucket, storage.current_config(), None, None

    def read(self, path: str) -> bytes:
        if self._pid != os.getpid():
            storage.configure(self.settings)  # a spawned worker starts with no endpoint set
            self._client, self._pid = storage.boto3_client(), os.getpid()
        return self._client.get_object(Bucket=self.bucket, Key=path)["Body"].read()


def upload_photos(items, root: str, bucket: str, prefix: str) -> list[tuple[str, int]]:
    """Put every photo at s3://bucket/prefix/<path under root>; returns the items as (key, label)."""
    from concurrent.futures import ThreadPoolExecutor

    client = storage.boto3_client()
    keyed = [(f"{prefix}/{Path(path).relative_to(root).as_posix()}", label) for path, label in items]

    def put(pair) -> None:
        (path, _), (key, _) = pair
        client.put_object(Bucket=bucket, Key=key, Body=Path(path).read_bytes())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, zip(items, keyed, strict=True)))
    return keyed


def torch_setting(items, img_size: int, train: bool, args, draft: bool = True, bucket: str = "") -> Pass:
    from torch.utils.data import DataLoader

    crop_draft = load_config(None, list(args.overrides)).data.crop_draft  # the same training view as Ray's
    view = ViewSpec(img_size, MEAN, STD, train=train, draft=draft, crop_draft=draft and crop_draft)
    dataset = S3FileDataset(items, view, bucket) if bucket else FileDataset(items, view)
    # spawned workers: a worker forked from this process (a Ray driver) shares its GCS connection, and
    # one that touched it left the driver's calls hanging ("Missing :authority header")
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=train, num_workers=args.workers,
                        persistent_workers=args.workers > 0,
                        multiprocessing_context="spawn" if args.workers > 0 else None)
    for _ in loader:  # untimed, as Ray's first pass: the workers start (spawn) and import
        pass
    return time_passes(lambda: iter(loader), args.epochs)


# ----------------------------------------------------------------------------- photo sets


def large_photos(spec: SourceSpec, out: Path, seed: int = 0) -> SourceSpec:
    """The same CUB layout with every photo resized up to a longer side of 800-1,200 px (JPEG q90)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    shutil.copytree(spec.uri, out, ignore=shutil.ignore_patterns("images"))
    for item in convert(spec).items:
        img = Image.open(item.source_path).convert("RGB")
        factor = int(rng.integers(800, 1201)) / max(img.size)
        path = out / "images" / Path(item.source_path).relative_to(Path(spec.uri) / "images")
        path.parent.mkdir(parents=True, exist_ok=True)
        img.resize((round(img.width * factor), round(img.height * factor)), Image.Resampling.BICUBIC) \
            .save(path, format="JPEG", quality=90)
    return SourceSpec(spec.kind, spec.name, str(out), max_per_class=spec.max_per_class)


def mean_pixels(items) -> float:
    from PIL import Image

    sizes = [Image.open(path).size for path, _ in items]
    return float(np.mean([w * h for w, h in sizes]))


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Prepare every photo set locally and on S3, then time the readers for both views."""
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
        rows = [row for name in args.sets for row in run_set(name, args, work)]
        report(rows, args)
        return 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=15)
        shutil.rmtree(work, ignore_errors=True)


def run_set(name: str, args: argparse.Namespace, work: Path) -> list[dict]:
    """Every setting on one photo set: a row per (setting, view)."""
    per_class = max(2, math.ceil(args.images / 100))
    spec = SourceSpec("cub", "cub", args.source, max_per_class=per_class)
    if name == "large":
        spec = large_photos(spec, work / "large")
    listing = convert(spec)
    items = {view: [(i.source_path, i.label) for i in listing.items if view == "eval" or i.split == "train"]
             for view in ("eval", "train")}  # the rows each Ray setting streams
    pixels = mean_pixels(items["eval"])
    print(f"[bench] {name}: {len(items['eval'])} photos, mean {math.sqrt(pixels):.0f} px side", flush=True)
    roots = {"local": (str(work / name / "prepared"), 0), "s3": (f"s3://{BUCKET}/{name}/prepared", 0)}
    if name == "large":
        roots["local-shrunk"] = (str(work / name / "shrunk"), args.max_side)
    manifests = {}
    for where, (uri, max_side) in roots.items():
        storage.ensure_bucket(uri)
        start = time.perf_counter()
        manifests[where] = prepare([spec], uri, shard_rows=500, log=lambda _: None,
                                   max_side=max_side).manifest
        print(f"[bench] prepare -> {where}: {time.perf_counter() - start:.1f}s", flush=True)
    start = time.perf_counter()
    keyed = dict(zip([path for path, _ in items["eval"]],
                     upload_photos(items["eval"], spec.uri, BUCKET, f"{name}/photos"), strict=True))
    s3_items = {view: [keyed[path] for path, _ in rows] for view, rows in items.items()}
    print(f"[bench] photos -> s3 (one object each): {time.perf_counter() - start:.1f}s", flush=True)
    settings = [("ray-local", "local", []), ("ray-s3", "s3", [])]
    if name == "large":
        settings += [("ray-local-full", "local", ["data.jpeg_draft=false"]),
                     ("ray-local-shrunk", "local-shrunk", [])]
    def ray_config(where: str, extra: list[str]):
        keys = [f"data.uri={manifests[where].uri}", f"train.batch_size={args.batch_size}",
                f"model.backbone.img_size={args.img_size}", f"data.rejects_uri={work / 'rejects.jsonl'}"]
        return load_config(None, [*keys, *extra, *args.overrides])

    for train in (False, True):  # untimed: Ray's workers start and import what each view needs
        ray_setting(ray_config("local", []), manifests["local"], train, 1)

    def runs(train: bool) -> list[tuple[str, object]]:  # (setting, a function that times it)
        view = "train" if train else "eval"
        local, remote = items[view], s3_items[view]
        out = [(setting, lambda w=where, e=extra: ray_setting(ray_config(w, e), manifests[w], train,
                                                              args.epochs))
               for setting, where, extra in settings]
        out += [("torch-local", lambda: torch_setting(local, args.img_size, train, args)),
                ("torch-s3", lambda: torch_setting(remote, args.img_size, train, args, bucket=BUCKET))]
        if name == "large":
            out.append(("torch-local-full",
                        lambda: torch_setting(local, args.img_size, train, args, draft=False)))
        return out

    rows = []
    for train in (False, True):
        view = "train" if train else "eval"
        for round_ in range(args.rounds):  # reversed every other round: drift over a round cancels
            order = runs(train) if round_ % 2 == 0 else runs(train)[::-1]
            rows += [{**_row(name, pixels, setting, view, timed()), "round": round_}
                     for setting, timed in order]
    return rows


def _row(photos: str, pixels: float, setting: str, view: str, result: Pass) -> dict:
    row = {"photos": photos, "mean_side_px": round(math.sqrt(pixels)), "setting": setting, "view": view,
           "rows": result.rows, "seconds": result.seconds, "cpu_seconds": result.cpu_seconds,
           "rows_per_s": result.rows_per_s, "rows_per_core_s": result.rows_per_core_s, "cores": result.cores}
    print(f"[bench] {photos} {setting}/{view}: {result.rows_per_s:.1f} rows/s, "
          f"{result.rows_per_core_s:.1f} rows per core-second ({result.cores:.2f} cores busy)", flush=True)
    return row


# ----------------------------------------------------------------------------- report


def gpu_images_per_s(path: str) -> tuple[float, str]:
    """(images/s of PUMA's training step on one GPU, device name) from bench_train.py's record, or (0, '')."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return 0.0, ""
    rates = [r["images_per_s"] for r in data.get("rows", []) if r.get("variant") == "puma step"]
    names = data.get("environment", {}).get("device", {}).get("names", [""])
    return (float(rates[0]), names[0]) if rates else (0.0, "")


def baseline(setting: str) -> str:
    """The DataLoader a setting is compared with: the one reading from the same storage."""
    return "torch-s3" if setting.endswith("-s3") else "torch-local"


def ratios(rows: list[dict]) -> list[dict]:
    """Per photo set, view and round: each setting's rows per core-second (and rows/s) over its baseline's,
    and every S3 row's also over torch-local's (what reading from S3 costs against local files)."""
    def base(row: dict, setting: str) -> dict:
        return next(r for r in rows if (r["photos"], r["view"], r.get("round", 0), r["setting"]) ==
                    (row["photos"], row["view"], row.get("round", 0), setting))

    out = []
    for row in rows:
        same, local = base(row, baseline(row["setting"])), base(row, "torch-local")
        out.append({**row, "baseline": baseline(row["setting"]),
                    "per_core_vs_torch": row["rows_per_core_s"] / same["rows_per_core_s"],
                    "rate_vs_torch": row["rows_per_s"] / same["rows_per_s"],
                    "per_core_vs_torch_local": row["rows_per_core_s"] / local["rows_per_core_s"]})
    return out


MEDIAN_KEYS = ("rows_per_s", "rows_per_core_s", "cores", "per_core_vs_torch", "rate_vs_torch",
               "per_core_vs_torch_local")


def medians(rows: list[dict]) -> list[dict]:
    """One row per (photo set, view, setting): the median over rounds of each figure, and the range of
    the per-core ratio over the rounds (``per_core_vs_torch_min`` / ``_max``)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["photos"], row["view"], row["setting"]), []).append(row)
    out = []
    for group in groups.values():
        first = {k: v for k, v in group[0].items() if k != "round"}
        ratio = [r["per_core_vs_torch"] for r in group]
        out.append({**first, **{k: float(np.median([r[k] for r in group])) for k in MEDIAN_KEYS},
                    "rounds": len(group), "per_core_vs_torch_min": min(ratio),
                    "per_core_vs_torch_max": max(ratio)})
    return out


def report(rows: list[dict], args: argparse.Namespace) -> None:
    per_round = ratios(rows)
    rows = medians(per_round)
    gpu_rate, gpu_name = gpu_images_per_s(args.train_record)
    lines = ["| photos (mean side) | view | setting | rows/s | rows per core-second | cores busy | "
             "per core vs DataLoader (same storage), median [range] | rows/s vs DataLoader (same storage) | "
             "S3 rows: per core vs torch-local |" + (" cores per GPU |" if gpu_rate else ""),
             "|---" * (9 + bool(gpu_rate)) + "|"]
    for r in rows:
        local = f"{r['per_core_vs_torch_local']:.2f}x" if r["baseline"] == "torch-s3" else "-"
        cells = [f"{r['photos']} ({r['mean_side_px']} px)", r["view"], r["setting"], f"{r['rows_per_s']:.1f}",
                 f"{r['rows_per_core_s']:.1f}", f"{r['cores']:.2f}", _ratio_cell(r),
                 f"{r['rate_vs_torch']:.2f}x", local]
        if gpu_rate:
            r["cores_per_gpu"] = gpu_rate / r["rows_per_core_s"]
            cells.append(f"{r['cores_per_gpu']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    notes = (f"{args.images} photos per set at {args.img_size} px, batch {args.batch_size}, "
             f"best of {args.epochs} passes per round, medians of {args.rounds} round(s), "
             f"Ray overrides {args.overrides or 'none'}, "
             f"DataLoader workers {args.workers}, "
             f"{os.cpu_count()} logical CPUs; shrunk: data.prepare_max_side={args.max_side}")
    if gpu_rate:
        notes += (f"; cores per GPU: PUMA's training step at {gpu_rate:,.0f} images/s on one {gpu_name} "
                  f"({Path(args.train_record).name}) over the row's rows per core-second")
    print(f"\n{notes}\n{text}")
    if args.record:
        payload = {"rows": rows, "rounds": per_round, "notes": notes, "gpu_images_per_s": gpu_rate}
        record(args.record, payload, notes + "\n\n" + text,
               title="Data pipeline: rows per CPU core, Ray Data vs a PyTorch DataLoader")


def _ratio_cell(row: dict) -> str:
    if row["rounds"] < 2 or row["setting"] == row["baseline"]:
        return f"{row['per_core_vs_torch']:.2f}x"
    low, high = row["per_core_vs_torch_min"], row["per_core_vs_torch_max"]
    return f"{row['per_core_vs_torch']:.2f}x [{low:.2f}-{high:.2f}]"


if __name__ == "__main__":
    raise SystemExit(main())
