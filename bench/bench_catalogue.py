"""A catalogue reconciled after 1% of it changed vs a full embed of it: seconds side by side in one run.

    python bench/bench_catalogue.py                          # 10,000 photos, the tests' tiny checkpoint
    python bench/bench_catalogue.py --n 2000 --model vit_s   # the demo's offline ViT-S/14 at 112 px

Catalogue: --n JPEG files in an image folder (``<scratch>/photos/part_NN/img_NNNNN.jpg``), cycled
from the sample photos in ../shared/data (12 flower species, 100 CUB species; 6,862 photos of 224-227 px,
3-22 KB, median 9 KB: smaller than most catalogues' photos, so decoding here is cheap).
Each file gets a JPEG comment segment naming it, so every file's bytes (and sha256 fingerprint)
are its own while its pixels, and so its decode cost, are the source photo's.

Runs: ``puma.inference.embed_catalogue`` (what jobs/embed.py runs) on one local Ray started before
any timing, after an untimed warm-up embed of --warmup other photos into another index, so neither
timed run pays Ray's start-up or its workers' first imports.

    full        a fresh index location: every item listed, read, decoded, embedded, committed
    reconcile   after --changed-fraction of the items changed: half rewritten with another photo
                under the same name, a quarter deleted, a quarter added under new names (the
                catalogue keeps --n items); only the rewritten and new files are embedded
    no-op       nothing changed since: listing and planning only, no image read

ratio = reconcile seconds / full seconds (issue 41's target: <= 0.05). Seconds are the wall time
of the embed_catalogue call. The breakdown splits each run by the job's own steps: listing
(list_catalogue: the folder's sizes and write times), index rows (live_items: the stored rows'
stamps and fingerprints), plan (comparing stamps; the files whose stamp changed are read and
hashed), model check (the driver loads the checkpoint once), commits (commit_changes: shard files,
removals, manifest), compaction and settle (versions); pipeline is the rest: Ray Data start-up,
the Embedder actor's start and model load, read + decode + embed, the driver's batches.
Results: bench/results/<--name, default bench_catalogue>.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))
sys.path.append(str(REPO / "tests"))  # tiny.py

import numpy as np  # noqa: E402

from bench.record import record  # noqa: E402
from puma.checkpoint import read_checkpoint  # noqa: E402
from puma.config import load_config  # noqa: E402

DATA = REPO.parent / "shared" / "data"
PHOTO_GLOBS = ("flowers12-subset/*/*.jpg", "cub200-subset/CUB_200_2011/images/*/*.jpg")
TARGET = 0.05  # the bound on reconcile seconds / full seconds
# the job's steps timed in each run: name -> (the puma.inference module calling it, the attribute wrapped)
STEPS = {"listing": ("planning", "list_catalogue"), "index rows": ("planning", "live_items"),
         "plan": ("planning", "plan"), "model check": ("job", "check_model"),
         "commits": ("commits", "commit_changes"), "compaction": ("commits", "compact"),
         "settle": ("job", "settle_version")}
FIRST_BATCH = "to first batch"  # from asking Ray Data for batches to the first embedded one (in a run)
BREAKDOWN = (*STEPS, "pipeline", FIRST_BATCH)  # the table's step columns
COUNTS = ("items", "embedded", "added", "changed", "removed", "restamped", "read_to_compare",
          "skipped_indexed", "rejected", "total")


@dataclasses.dataclass
class Change:
    """What was done to the catalogue between the full run and the reconcile (item file names)."""

    replaced: list[str]
    deleted: list[str]
    added: list[str]


# ----------------------------------------------------------------------------- the catalogue


def source_photos() -> list[Path]:
    """The sample photos, flowers then CUB, sorted."""
    photos = [p for pattern in PHOTO_GLOBS for p in sorted(DATA.glob(pattern))]
    if not photos:
        raise SystemExit(f"no sample photos under {DATA} ({', '.join(PHOTO_GLOBS)})")
    return photos


def tagged_jpeg(data: bytes, tag: str) -> bytes:
    """The JPEG with a comment (COM) segment holding ``tag`` after its SOI marker: own bytes, same pixels."""
    if data[:2] != b"\xff\xd8":
        raise SystemExit(f"expected a JPEG (FF D8 ...), got bytes starting {data[:4]!r}")
    text = tag.encode()
    return data[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + data[2:]


def item_path(root: Path, i: int) -> Path:
    """Where item i lives: 1,000 files per sub-folder."""
    return root / f"part_{i // 1000:02d}" / f"img_{i:05d}.jpg"


def write_photo(path: Path, photo: Path, tag: str) -> None:
    """A copy of photo at path, tagged (its own bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(tagged_jpeg(photo.read_bytes(), tag))


def make_catalogue(root: Path, n: int, photos: list[Path]) -> None:
    """n distinct files, item i a copy of photo i mod len(photos)."""
    for i in range(n):
        write_photo(item_path(root, i), photos[i % len(photos)], f"bench_catalogue item {i}")


def change_catalogue(root: Path, n: int, photos: list[Path], fraction: float, seed: int) -> Change:
    """Change round(n * fraction) items: half rewritten with another photo, a quarter deleted, as
    many added under new names."""
    k = round(n * fraction)
    deleted_count = k // 4
    chosen = np.random.default_rng(seed).choice(n, size=k - deleted_count, replace=False)
    replaced, deleted = chosen[:k - 2 * deleted_count], chosen[k - 2 * deleted_count:]
    for i in replaced:  # another photo (half the sample away), new bytes under the same name
        write_photo(item_path(root, int(i)), photos[(int(i) + len(photos) // 2) % len(photos)],
                    f"bench_catalogue item {i}, replaced")
    for i in deleted:
        item_path(root, int(i)).unlink()
    added = range(n, n + deleted_count)
    for i in added:
        write_photo(item_path(root, i), photos[i % len(photos)], f"bench_catalogue item {i}, added")
    return Change([item_path(root, int(i)).name for i in replaced],
                  [item_path(root, int(i)).name for i in deleted], [item_path(root, i).name for i in added])


# ----------------------------------------------------------------------------- the model


def make_model(kind: str, img_size: int, uri: str) -> str:
    """A checkpoint at uri: the tests' tiny PUMA model, or the demo's offline ViT-S/14 with fresh
    PUMA modules (bench_embed.make_checkpoint)."""
    if kind == "tiny":
        from tiny import make_checkpoint

        return make_checkpoint(uri)
    from bench_embed import make_checkpoint

    return make_checkpoint(kind, img_size, uri)[0]


def describe_model(checkpoint: str) -> str:
    """The checkpoint's model in one line (method, backbone, input size, embedding size)."""
    model = read_checkpoint(checkpoint).config.model
    kwargs = model.backbone.model_kwargs
    shape = f" (depth {kwargs['depth']}, width {kwargs['embed_dim']})" if "depth" in kwargs else ""
    return (f"{model.method}: {model.backbone.name}{shape} at {model.backbone.img_size} px, "
            f"embedding {model.head.embed_dim}")


# ----------------------------------------------------------------------------- the runs


@contextlib.contextmanager
def step_timer() -> Iterator[dict[str, float]]:
    """Seconds spent inside each of the job's STEPS while the block runs (wrappers, then restored)."""
    import importlib

    seconds = dict.fromkeys([*STEPS, FIRST_BATCH], 0.0)
    names = {module for module, _ in STEPS.values()} | {"running"}
    modules = {name: importlib.import_module(f"puma.inference.{name}") for name in names}
    originals = {where: getattr(modules[where[0]], where[1]) for where in STEPS.values()}

    def timed(name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
        return wrapper

    def first_batch(fn):  # the pipeline's start: from asking for batches to the first embedded one
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            batches = iter(fn(*args, **kwargs))
            first = next(batches, None)
            seconds[FIRST_BATCH] += time.perf_counter() - start
            if first is not None:
                yield first
                yield from batches
        return wrapper

    wrapped = {where: timed(name, originals[where]) for name, where in STEPS.items()}
    stream = ("running", "_stream")
    originals[stream] = modules["running"]._stream
    wrapped[stream] = first_batch(originals[stream])
    for (module, attr), fn in wrapped.items():
        setattr(modules[module], attr, fn)
    try:
        yield seconds
    finally:
        for (module, attr), fn in originals.items():
            setattr(modules[module], attr, fn)


def timed_run(cfg, catalogue: Path) -> dict:
    """One embed_catalogue call: its wall seconds, report counts and step breakdown."""
    from puma.inference.job import embed_catalogue

    load = [os.getloadavg()[0]]  # the machine's 1-minute load average: others' work shows here
    with step_timer() as steps:
        start = time.perf_counter()
        report = embed_catalogue(cfg, str(catalogue))
        seconds = time.perf_counter() - start
    steps["pipeline"] = max(0.0, seconds - sum(steps[s] for s in STEPS))  # FIRST_BATCH is a part of it
    load.append(os.getloadavg()[0])
    counts = {c: getattr(report, c) for c in COUNTS}
    return {"seconds": seconds, "steps": steps, "load_average": load, **counts}


def check(name: str, run: dict, expected: dict[str, int]) -> list[str]:
    """What differs from the expected counts, one line each."""
    return [f"{name}: {key} = {run[key]}, expected {value}" for key, value in expected.items()
            if run[key] != value]


def expectations(n: int, change: Change) -> dict[str, dict[str, int]]:
    """The counts each run must report."""
    return {"full": {"embedded": n, "added": n, "removed": 0, "rejected": 0, "total": n},
            "reconcile": {"embedded": len(change.replaced) + len(change.added),
                          "changed": len(change.replaced), "added": len(change.added),
                          "removed": len(change.deleted), "read_to_compare": len(change.replaced),
                          "total": n},
            "no-op": {"embedded": 0, "added": 0, "changed": 0, "removed": 0, "read_to_compare": 0,
                      "total": n}}


# ----------------------------------------------------------------------------- output


def table(runs: dict[str, dict]) -> str:
    """Markdown: one row per run, seconds, images/s, x full, counts and the step breakdown."""
    full = runs["full"]["seconds"]
    cols = ["run", "seconds", "x full", "embedded", "images/s", "added", "changed", "removed",
            "read to compare", "total", *(f"{s} s" for s in BREAKDOWN), "load before-after"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, r in runs.items():
        rate = f"{r['embedded'] / r['seconds']:.1f}" if r["embedded"] else "-"
        cells = [name, f"{r['seconds']:.2f}", f"{r['seconds'] / full:.4f}", str(r["embedded"]), rate,
                 str(r["added"]), str(r["changed"]), str(r["removed"]), str(r["read_to_compare"]),
                 str(r["total"]), *(f"{r['steps'][s]:.2f}" for s in BREAKDOWN),
                 "{:.1f}-{:.1f}".format(*r["load_average"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(runs: dict[str, dict], n: int, change: Change, model: str) -> str:
    """What changed, which model, the ratio against the target and the full run's images/s."""
    ratio = runs["reconcile"]["seconds"] / runs["full"]["seconds"]
    verdict = "met" if ratio <= TARGET else "NOT met"
    return (f"{n} items; changed {len(change.replaced)} (rewritten), deleted {len(change.deleted)}, "
            f"added {len(change.added)}. Model: {model}.\n\n"
            f"**reconcile / full = {ratio:.4f}** (target <= {TARGET}: {verdict}); full embed "
            f"{runs['full']['embedded'] / runs['full']['seconds']:.1f} images/s.")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10_000, help="items in the catalogue (default 10,000)")
    p.add_argument("--changed-fraction", type=float, default=0.01,
                   help="items changed before the reconcile (half rewritten, a quarter deleted, as many "
                   "added)")
    p.add_argument("--checkpoint", default="",
                   help="the model to embed with (default: one built in the scratch folder, see --model)")
    p.add_argument("--model", choices=("tiny", "vit_s"), default="tiny",
                   help="without --checkpoint: the tests' tiny PUMA model, or the demo's offline ViT-S/14")
    p.add_argument("--img-size", type=int, default=112, help="ViT-S input size (the demo's 112)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a job config override (dotted key), e.g. embed.batch_size=32; repeatable")
    p.add_argument("--warmup", type=int, default=64, help="photos of the untimed warm-up embed")
    p.add_argument("--seed", type=int, default=0, help="which items change")
    p.add_argument("--out-dir", default="", help="scratch folder for photos, index and checkpoint "
                   "(default: a temp folder); must be new or empty")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--name", default="bench_catalogue", help="results file name in bench/results/")
    args = p.parse_args(argv)
    if args.n < 4 or not 0 < args.changed_fraction <= 0.5:
        p.error("--n must be >= 4 and --changed-fraction in (0, 0.5]")
    return args


def scratch_folder(out_dir: str) -> Path:
    """--out-dir (new or empty) or a new temp folder."""
    if not out_dir:
        return Path(tempfile.mkdtemp(prefix="bench_catalogue_"))
    path = Path(out_dir)
    if path.exists() and any(path.iterdir()):
        raise SystemExit(f"--out-dir {path} is not empty; give a new or empty folder")
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_all(args: argparse.Namespace, root: Path) -> tuple[dict, Change, str]:
    """Build, time the three runs, check their counts; returns (runs, change, model)."""
    from puma.runtime import init_ray

    photos = source_photos()
    checkpoint = args.checkpoint or make_model(args.model, args.img_size, str(root / "checkpoint"))
    model = describe_model(checkpoint)
    start = time.perf_counter()
    make_catalogue(root / "photos", args.n, photos)
    make_catalogue(root / "warmup", min(args.warmup, args.n), photos[::-1])
    print(f"[bench] {args.n} photos written in {time.perf_counter() - start:.1f} s; model {model}; "
          f"load average {os.getloadavg()[0]:.1f}; Ray: {init_ray()}", flush=True)
    cfg = load_config(None, [f"index.uri={root / 'index'}", f"embed.checkpoint={checkpoint}", *args.set])
    warm = dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, uri=str(root / "warmup_index")))
    print(f"[bench] warm-up ({timed_run(warm, root / 'warmup')['seconds']:.1f} s, untimed)", flush=True)
    runs = {"full": timed_run(cfg, root / "photos")}
    change = change_catalogue(root / "photos", args.n, photos, args.changed_fraction, args.seed)
    runs["reconcile"] = timed_run(cfg, root / "photos")
    runs["no-op"] = timed_run(cfg, root / "photos")
    expected = expectations(args.n, change)
    wrong = [line for name, run in runs.items() for line in check(name, run, expected[name])]
    if wrong:
        raise SystemExit("counts differ from what the catalogue's changes imply:\n  " + "\n  ".join(wrong))
    return runs, change, model


def main(argv: list[str] | None = None) -> int:
    """Build the catalogue, time full / reconcile / no-op, check their counts, print and record."""
    args = parse_args(argv)
    root = scratch_folder(args.out_dir)
    try:
        runs, change, model = run_all(args, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    text = table(runs) + "\n\n" + summary(runs, args.n, change, model)
    print(text)
    ratio = runs["reconcile"]["seconds"] / runs["full"]["seconds"]
    payload = {"n": args.n, "changed_fraction": args.changed_fraction, "seed": args.seed, "model": model,
               "checkpoint": args.checkpoint or f"built here (--model {args.model})", "overrides": args.set,
               "change": {k: len(v) for k, v in dataclasses.asdict(change).items()}, "runs": runs,
               "ratio_reconcile_full": ratio, "target": TARGET, "target_met": ratio <= TARGET,
               "full_images_per_s": runs["full"]["embedded"] / runs["full"]["seconds"]}
    notes = ("\n\nSeconds: wall time of each `embed_catalogue` call (Ray started and warmed up before). "
             "Step columns: seconds inside the job's steps (see the bench's docstring); pipeline = the rest "
             "(Ray Data, the Embedder actor, read + decode + embed)."
             + (f" Scratch kept at {root}." if args.keep else ""))
    record(args.name, payload, text + notes,
           title=f"bench_catalogue: reconcile after {args.changed_fraction:.0%} changed vs a full embed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
