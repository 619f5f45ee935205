"""PyTorch eager vs ONNX Runtime fp32 vs ONNX Runtime int8: speed, agreement and retrieval, in one run.

    python bench/bench_onnx.py                  # 256 CUB photos, offline ViT-S/14 at 112 px, 2 threads
    python bench/bench_onnx.py --model tiny     # a tiny ViT (no weights needed)
    python bench/bench_onnx.py --checkpoint artifacts/runs/demo/best --data artifacts/data/demo
                                                # a trained checkpoint on the test split of --data

All three embed the same eval views (decoded once, untimed) in batches of --batch-size with
--threads intra-op threads (torch.set_num_threads; ONNX Runtime intra_op_num_threads).

    img/core-s    images / (seconds x threads), best of --repeats passes after one warm-up pass,
                  the runtimes interleaved pass by pass
    cosine        per-image cosine of the ONNX Runtime embeddings to PyTorch's (min and mean)
    R@1, MAP@R    puma.eval.metrics.evaluate_embeddings on the photos by CUB class, all-vs-all
                  (each photo queries the others, itself excluded); --per-class photos from each
                  of the first --n / --per-class classes

Without --checkpoint the model is built here: the offline DINOv2 backbone (artifacts/weights) with
freshly initialised PUMA modules (adapters, prompt pool, head). Speed does not depend on trained
values; R@1 / MAP@R are those of this untrained model, so compare fp32 with int8, not with the paper.
With --checkpoint (a trained one, e.g. the demo's) and --data (prepared data): retrieval is the
training evaluation's protocol on every test image of --data (per dataset, harmonic and unified
R@1 and MAP@R), speed is timed on the first --n of them.
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
from puma import storage  # noqa: E402
from puma.checkpoint import checkpoint_id, load_model, resolve_checkpoint  # noqa: E402
from puma.data import schema  # noqa: E402
from puma.data.images import eval_view_spec, make_view  # noqa: E402
from puma.data.manifest import load_manifest  # noqa: E402
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


def timed(runs: dict, views: np.ndarray, batch_size: int, repeats: int) -> dict[str, float]:
    """The best seconds of each run over ``repeats`` passes of ``views``, the runs interleaved pass by pass
    after one warm-up pass each (drift of a noisy machine then falls on every run alike)."""
    def one_pass(run) -> None:
        for i in range(0, len(views), batch_size):
            run(views[i:i + batch_size])

    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():
        one_pass(run)
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            one_pass(run)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))


def retrieval(emb: np.ndarray, labels: np.ndarray, datasets: np.ndarray,
              roles: np.ndarray) -> dict[str, float]:
    """Harmonic and unified R@1 and MAP@R (one dataset: its own) by the training evaluation's protocol."""
    metrics = evaluate_embeddings(emb, labels, datasets, roles, ks=(1,))
    return {f"{group[0]}_{name}": metrics[f"{group}/{name}"] for group in ("harmonic", "unified")
            for name in ("r@1", "map@r")}


def split_views(data_uri: str, spec, split: str = schema.TEST) -> tuple[np.ndarray, ...]:
    """Eval views (N, 3, S, S), labels, datasets and roles of every image of a split of prepared data."""
    import pyarrow.parquet as pq

    views, labels, datasets, roles = [], [], [], []
    for uri in load_manifest(data_uri).shard_uris(split):
        fs, path = storage.resolve(uri)
        table = pq.read_table(path, filesystem=fs, columns=[schema.IMAGE, schema.LABEL, schema.DATASET,
                                                            schema.ROLE])
        views += [make_view(b, spec) for b in table[schema.IMAGE].to_pylist()]
        labels += table[schema.LABEL].to_pylist()
        datasets += table[schema.DATASET].to_pylist()
        roles += table[schema.ROLE].to_pylist()
    return np.stack(views), np.asarray(labels, np.int64), np.asarray(datasets), np.asarray(roles)


def prepare(args, tmp: str):
    """(model, cfg, fp32 ONNX bytes, views, labels, datasets, roles, what the checkpoint is)."""
    if args.checkpoint:
        ckpt = resolve_checkpoint(args.checkpoint)
        model, cfg = load_model(ckpt)  # eval mode, probe verified
        fp32 = onnx_bytes(model, cfg, checkpoint_id(ckpt))
        views, labels, datasets, roles = split_views(args.data, eval_view_spec(cfg))
        return model, cfg, fp32, views, labels, datasets, roles, (
            f"trained checkpoint {args.checkpoint}, every test image of {args.data}")
    ckpt, model, cfg = make_checkpoint(args.model, args.img_size, f"{tmp}/ckpt")
    fp32 = onnx_bytes(model, cfg, checkpoint_id(ckpt))
    paths, labels = cub_photos(args.n, args.per_class)
    spec = eval_view_spec(cfg)
    views = np.stack([make_view(p.read_bytes(), spec) for p in paths])  # (N, 3, S, S)
    n = len(labels)
    return model, cfg, fp32, views, labels, np.array(["cub"] * n), np.array(["query"] * n), (
        f"{CHECKPOINT_TEXT[args.model]} (no trained PUMA checkpoint: compare fp32 with int8); {n} CUB-200 "
        f"photos ({args.per_class} per class, {n // args.per_class} classes), all-vs-all")


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("vit_s", "tiny"), default="vit_s" if WEIGHTS.exists() else "tiny")
    parser.add_argument("--img-size", type=int, default=112, help="ViT-S input size (the demo's 112)")
    parser.add_argument("--checkpoint", default="", help="a trained checkpoint (then --data is evaluated)")
    parser.add_argument("--data", default="artifacts/data/demo", help="prepared data (with --checkpoint)")
    parser.add_argument("--n", type=int, default=256, help="images timed (without --checkpoint: CUB photos)")
    parser.add_argument("--per-class", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Embed the images with each runtime, print and record the table."""
    args = parse(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as tmp:
        model, cfg, fp32, views, labels, datasets, roles, what = prepare(args, tmp)
    int8 = quantize_int8(fp32)
    timed_views = views[: args.n]
    print(f"[bench] {len(views)} images ({len(timed_views)} timed), {cfg.model.backbone.name} at "
          f"{cfg.model.backbone.img_size} px, batch {args.batch_size}, {args.threads} threads; {what}",
          flush=True)

    def torch_run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(x)).float().numpy()

    runs = {"torch eager fp32": torch_run}
    for name, data in (("onnxruntime fp32", fp32), ("onnxruntime int8", int8)):
        sess = session(data, args.threads)
        runs[name] = lambda x, sess=sess: embed(sess, x)
    best = timed(runs, timed_views, args.batch_size, args.repeats)
    rows, reference, step = [], None, args.batch_size
    for name, run in runs.items():
        seconds = best[name]
        emb = np.concatenate([run(views[i:i + step]) for i in range(0, len(views), step)])  # (N, E)
        reference = emb if reference is None else reference
        cos = cosines(emb, reference)
        size = len(fp32) if name.endswith("fp32") else len(int8)
        rows.append({"runtime": name, "seconds": seconds,
                     "img_per_core_s": len(timed_views) / (seconds * args.threads),
                     "file_mb": None if name.startswith("torch") else size / 1e6,
                     "min_cosine_to_torch": float(cos.min()), "mean_cosine_to_torch": float(cos.mean()),
                     **retrieval(emb, labels, datasets, roles)})
        print(f"[bench] {name}: {rows[-1]['img_per_core_s']:.1f} img/core-s, harmonic R@1 "
              f"{rows[-1]['h_r@1']:.4f}", flush=True)
    for row in rows:
        row["speed_vs_torch"] = row["img_per_core_s"] / rows[0]["img_per_core_s"]
        for key in ("h_r@1", "h_map@r", "u_r@1", "u_map@r"):
            row[f"{key}_minus_torch"] = row[key] - rows[0][key]
    lines = ["| runtime | img/core-s | x torch | file MB | min cos | mean cos | harmonic R@1 | (- torch) | "
             "harmonic MAP@R | unified R@1 | unified MAP@R |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mb = "" if r["file_mb"] is None else f"{r['file_mb']:.1f}"
        lines.append(f"| {r['runtime']} | {r['img_per_core_s']:.1f} | {r['speed_vs_torch']:.2f} | {mb} | "
                     f"{r['min_cosine_to_torch']:.5f} | {r['mean_cosine_to_torch']:.5f} | {r['h_r@1']:.4f} | "
                     f"{r['h_r@1_minus_torch']:+.4f} | {r['h_map@r']:.4f} | {r['u_r@1']:.4f} | "
                     f"{r['u_map@r']:.4f} |")
    table = "\n".join(lines)
    print(table)
    setup = (f"Checkpoint and images: **{what}**; eval views at {cfg.model.backbone.img_size} px decoded "
             f"once. Speed on the first {len(timed_views)} images: batch {args.batch_size}, {args.threads} "
             f"threads, best of {args.repeats} passes after a warm-up, the runtimes interleaved pass by pass;"
             " img/core-s = images / (seconds x threads). "
             "Cosine to torch eager per image; R@1 and MAP@R by the training evaluation's protocol "
             "(puma.eval.metrics.evaluate_embeddings). int8: ONNX Runtime dynamic quantisation "
             "(puma.export.quantize_int8: weights QInt8 per output channel).")
    payload = {"checkpoint": args.checkpoint or CHECKPOINT_TEXT[args.model], "data": args.data,
               "img_size": cfg.model.backbone.img_size, "images": len(views), "timed": len(timed_views),
               "batch_size": args.batch_size, "threads": args.threads, "repeats": args.repeats, "rows": rows}
    name = "bench_onnx_trained" if args.checkpoint else "bench_onnx"
    record(name, payload, f"{setup}\n\n{table}", "PyTorch vs ONNX Runtime fp32 vs int8 (CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
