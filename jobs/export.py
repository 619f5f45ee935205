"""Export a checkpoint's embedding model to ONNX: `python jobs/export.py --checkpoint URI --out PATH`.

The file runs anywhere ONNX Runtime does, without this project: input `images` float32 (B, 3, S, S)
(the eval view, normalised), output `embeddings` float32 (B, E); its metadata names the model id the
index records, the input size, the normalisation and the method (docs/export.md). The export is
refused unless ONNX Runtime gives PyTorch's embeddings within cosine 0.9999 on probe images.
`--int8` also writes `<out without .onnx>.int8.onnx` (int8 weights, smaller, some accuracy lost) and
prints its min cosine to the fp32 file on the probe images (reported, not a gate).
Example: `python jobs/export.py --checkpoint artifacts/runs/demo/best --out artifacts/export/demo.onnx`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.cli import job_main, job_parser, parse_job_args  # noqa: E402


@job_main
def main(argv: list[str] | None = None) -> int:
    """Parse, export, print what was written."""
    parser = job_parser(__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="",
                        help="checkpoint folder (default: <train.storage_path>/<train.run_name>/best)")
    parser.add_argument("--out", required=False, default="", help="the .onnx file to write (local or s3://)")
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset (>= 17)")
    parser.add_argument("--int8", action="store_true", help="also write <out>.int8.onnx (int8 weights)")
    args, cfg = parse_job_args(parser, argv)
    if cfg is None:
        return 0
    if not args.out or args.opset < 17:
        print("error: give --out PATH.onnx (and --opset 17 or later)", file=sys.stderr)
        return 2
    from puma import storage
    from puma.checkpoint import best_checkpoint_uri
    from puma.export import export_onnx, int8_agreement, quantize_int8

    checkpoint = args.checkpoint or best_checkpoint_uri(cfg)
    int8_out = args.out.removesuffix(".onnx") + ".int8.onnx"
    storage.preflight(cfg.storage, inputs=[checkpoint], outputs=[args.out] + [int8_out] * args.int8)
    out = storage.absolute(args.out)
    report = export_onnx(checkpoint, out, cfg.embed.backbone_weights or None, args.opset)
    print(f"[puma] exported {report.summary()}")
    if args.int8:
        fp32 = storage.read_bytes(out)
        int8 = quantize_int8(fp32)
        storage.write_bytes(storage.absolute(int8_out), int8)
        print(f"[puma] int8 {int8_out}: {len(int8) / 1e6:.1f} MB; min cosine to fp32 "
              f"{int8_agreement(fp32, int8, report.img_size):.6f} on the probe images (not a gate)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
