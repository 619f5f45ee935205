"""PyTorch eager vs ONNX Runtime fp32 vs ONNX Runtime int8: speed, agreement and retrieval, in one run.

    python bench/bench_onnx.py                  # 256 CUB photos, offline ViT-S/14 at 112 px, 2 threads
    python bench/bench_onnx.py --model tiny     # a tiny ViT (no weights needed)

All three embed the same eval views (decoded once, untimed) in batches of --batch-size with
--threads intra-op threads (torch.set_num_threads; ONNX Runtime intra_op_num_threads).

    img/core-s    images / (seconds x threads), best of --repeats passes after one warm-up pass
    cosine        per-image cosine of the ONNX Runtime embeddings to PyTorch's (min and mean)
    R@1, MAP@R    puma.eval.metrics.evaluate_embeddings on the photos by CUB class, all-vs-all
                  (each photo queries the others, itself excluded); --per-class photos from each
                  of the first --n / --per-class classes

The checkpoint is built here: the offline DINOv2 backbone (artifacts/weights) with freshly
initialised PUMA modules (adapters, prompt pool, head), not a trained PUMA checkpoint. Speed does
not depend on trained values; R@1 / MAP@R are those of this untrained model, so compare fp32 with
int8, not with the paper.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.bench_embed import CUB_IMAGES, WEIGHTS, make_checkpoint  # noqa: E402
from bench.record import record  # noqa: E402
from puma.checkpoint import checkpoint_id  # noqa: E402
from puma.data.images import eval_view_spec, make_view  # noqa: E402
from puma.eval.metrics import evaluate_embeddings  # noqa: E402
from puma.export import embed, onnx_bytes, quantize_int8, session  # noqa: E402

CHECKPOINT_TEXT = {"vit_s": "offline DINOv2 ViT-S/14 backbone (artifacts/weights) + untrained PUMA modules",
                   "tiny": "tiny random ViT + untrained PUMA modules"}


def cub_photos(n: int, per_class: int) -> tuple[list[Path], np.ndarray]:
    """per_class photos from each of the first n / per_class CUB classes, and their class labels."""
    classes = sorted(p for p in CUB_IMAGES.iterdir() if p.is_dir())[: n // per_class]
    paths, labels = [], []
    for label, folder in enumerate(classes):
        for p in sorted(folder.glob("*.jpg"))[:per_class]:
            paths.append(p)
            labels.append(label)
    if len(paths) != n:
        raise SystemExit(f"found {len(paths)} CUB photos under {CUB_IMAGES}, asked for {n}")
    return paths, np.asarray(labels, np.int64)


def timed(run, views: np.ndarray, batch_size: int, repeats: int) -> tuple[np.ndarray, float]:
    """Embeddings (N, E) of views (N, 3, S, S) and the best seconds of ``repeats`` passes after a warm-up."""
    def one_pass() -> np.ndarray:
        return np.concatenate([run(views[i:i + batch_size]) for i in range(0, len(views), batch_size)])

    out = one_pass()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    return out, best


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))


def retrieval(emb: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """R@1 and MAP@R, all-vs-all on one dataset."""
    n = len(labels)
    metrics = evaluate_embeddings(emb, labels, np.array(["cub"] * n), np.array(["gallery"] * n), ks=(1,))
    return {"r@1": metrics["cub/r@1"], "map@r": metrics["cub/map@r"]}


def main(argv: list[str] | None = None) -> int:
    """Embed the photos with each runtime, print and record the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("vit_s", "tiny"), default="vit_s" if WEIGHTS.exists() else "tiny")
    parser.add_argument("--img-size", type=int, default=112, help="ViT-S input size (the demo's 112)")
    parser.add_argument("--n", type=int, default=256, help="CUB photos")
    parser.add_argument("--per-class", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as tmp:
        ckpt, model, cfg = make_checkpoint(args.model, args.img_size, f"{tmp}/ckpt")
        fp32 = onnx_bytes(model, cfg, checkpoint_id(ckpt))
    int8 = quantize_int8(fp32)
    paths, labels = cub_photos(args.n, args.per_class)
    spec = eval_view_spec(cfg)
    views = np.stack([make_view(p.read_bytes(), spec) for p in paths])  # (N, 3, S, S)
    print(f"[bench] {args.n} CUB photos ({args.per_class} per class), {cfg.model.backbone.name} at "
          f"{spec.img_size} px, batch {args.batch_size}, {args.threads} threads; "
          f"checkpoint: {CHECKPOINT_TEXT[args.model]}", flush=True)

    def torch_run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(x)).float().numpy()

    runs = {"torch eager fp32": torch_run}
    for name, data in (("onnxruntime fp32", fp32), ("onnxruntime int8", int8)):
        sess = session(data, args.threads)
        runs[name] = lambda x, sess=sess: embed(sess, x)
    rows, reference = [], None
    for name, run in runs.items():
        emb, seconds = timed(run, views, args.batch_size, args.repeats)
        reference = emb if reference is None else reference
        cos = cosines(emb, reference)
        size = len(fp32) if name.endswith("fp32") else len(int8)
        rows.append({"runtime": name, "seconds": seconds, "img_per_core_s": args.n / (seconds * args.threads),
                     "file_mb": None if name.startswith("torch") else size / 1e6,
                     "min_cosine_to_torch": float(cos.min()), "mean_cosine_to_torch": float(cos.mean()),
                     **retrieval(emb, labels)})
        print(f"[bench] {name}: {rows[-1]['img_per_core_s']:.1f} img/core-s", flush=True)
    for row in rows:
        row["speed_vs_torch"] = row["img_per_core_s"] / rows[0]["img_per_core_s"]
    lines = ["| runtime | img/core-s | x torch | file MB | min cos | mean cos | R@1 | MAP@R |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mb = "" if r["file_mb"] is None else f"{r['file_mb']:.1f}"
        lines.append(f"| {r['runtime']} | {r['img_per_core_s']:.1f} | {r['speed_vs_torch']:.2f} | {mb} | "
                     f"{r['min_cosine_to_torch']:.5f} | {r['mean_cosine_to_torch']:.5f} | {r['r@1']:.4f} | "
                     f"{r['map@r']:.4f} |")
    table = "\n".join(lines)
    print(table)
    setup = (f"Checkpoint: **{CHECKPOINT_TEXT[args.model]}** (no trained PUMA checkpoint; retrieval "
             f"figures are for comparing fp32 with int8). {args.n} CUB-200 photos ({args.per_class} per "
             f"class, {args.n // args.per_class} classes), eval views at {spec.img_size} px decoded once; "
             f"batch {args.batch_size}, {args.threads} threads; best of {args.repeats} after a warm-up; "
             "img/core-s = images / (seconds x threads); cosine to torch eager; R@1 and MAP@R all-vs-all "
             "by class (puma.eval.metrics.evaluate_embeddings). int8: ONNX Runtime dynamic quantisation, "
             "weights QInt8 (puma.export.quantize_int8).")
    payload = {"model": args.model, "checkpoint": CHECKPOINT_TEXT[args.model], "img_size": spec.img_size,
               "n": args.n, "per_class": args.per_class, "batch_size": args.batch_size,
               "threads": args.threads, "repeats": args.repeats, "rows": rows}
    record("bench_onnx", payload, f"{setup}\n\n{table}", "PyTorch vs ONNX Runtime fp32 vs int8 (CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
