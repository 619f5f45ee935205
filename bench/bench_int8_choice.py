"""How to quantise the ONNX export to int8, chosen on training images (never the test split).

    python bench/bench_int8_choice.py --checkpoint artifacts/runs/demo/best --data artifacts/data/demo

Each variant of ONNX Runtime's dynamic quantisation embeds every *training* image of --data with the
trained checkpoint; rows compare it with the fp32 export: cosine per image (min, mean) and harmonic
R@1 / MAP@R all-vs-all within each dataset (puma.eval.metrics.evaluate_embeddings). The variant with
retrieval closest to fp32 is what puma.export.quantize_int8 uses (docs/export.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.bench_onnx import cosines, retrieval, split_views  # noqa: E402
from bench.record import record  # noqa: E402
from puma.checkpoint import load_model, resolve_checkpoint  # noqa: E402
from puma.data import schema  # noqa: E402
from puma.data.images import eval_view_spec  # noqa: E402
from puma.export import embed, onnx_bytes, session  # noqa: E402

VARIANTS = {"per tensor (ONNX Runtime's default)": {},
            "per channel": {"per_channel": True},
            "per channel, 7-bit (taken)": {"per_channel": True, "reduce_range": True},
            "per channel, MatMul only": {"per_channel": True, "op_types_to_quantize": ["MatMul"]}}


def quantised(fp32: bytes, options: dict) -> bytes:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="int8-choice-") as tmp:
        Path(tmp, "fp32.onnx").write_bytes(fp32)
        quantize_dynamic(f"{tmp}/fp32.onnx", f"{tmp}/int8.onnx", weight_type=QuantType.QInt8, **options)
        return Path(tmp, "int8.onnx").read_bytes()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="artifacts/runs/demo/best")
    parser.add_argument("--data", default="artifacts/data/demo")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, cfg = load_model(resolve_checkpoint(args.checkpoint))
    fp32 = onnx_bytes(model, cfg)
    views, labels, datasets, _ = split_views(args.data, eval_view_spec(cfg), schema.TRAIN)
    roles = np.array([schema.QUERY] * len(labels))  # all-vs-all within each dataset

    def run(data: bytes) -> np.ndarray:
        sess = session(data, args.threads)
        return np.concatenate([embed(sess, views[i:i + 32]) for i in range(0, len(views), 32)])

    reference = run(fp32)
    rows = [{"variant": "fp32", "min_cosine": 1.0, "mean_cosine": 1.0,
             **retrieval(reference, labels, datasets, roles)}]
    for name, options in VARIANTS.items():
        emb = run(quantised(fp32, options))
        cos = cosines(emb, reference)
        rows.append({"variant": name, "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
                     **retrieval(emb, labels, datasets, roles)})
        print(f"[bench] {name}: mean cosine {cos.mean():.5f}, harmonic R@1 {rows[-1]['h_r@1']:.4f}",
              flush=True)
    lines = ["| int8 weights | mean cosine to fp32 | min cosine | harmonic R@1 | harmonic MAP@R |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['mean_cosine']:.5f} | {r['min_cosine']:.4f} | {r['h_r@1']:.4f} | "
              f"{r['h_map@r']:.4f} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    setup = (f"Trained checkpoint {args.checkpoint}; every training image of {args.data} ({len(labels)}), "
             f"eval view at {cfg.model.backbone.img_size} px, {args.threads} threads. ONNX Runtime dynamic "
             "quantisation, weights QInt8; retrieval all-vs-all within each dataset by class.")
    record("bench_int8_choice", {"checkpoint": args.checkpoint, "data": args.data, "images": len(labels),
                                 "rows": rows}, f"{setup}\n\n{table}", "int8 quantisation: the choice")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
