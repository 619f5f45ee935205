"""Evaluate through a sharded index: `python jobs/evaluate.py [--index URI] [--config FILE] [key=value ...]`.

Recall@k, MAP@R and R-Precision per dataset, unified and harmonic (definitions in
puma/eval/metrics.py), every neighbour searched through the index at index.uri (or --index).
With --embed, or when no index exists there yet, the test split of data.uri is first embedded
into it (puma.inference). Metrics go to <index>/evaluation.json, or --out.
Example: `python jobs/evaluate.py --index artifacts/index/demo index.nprobe=32`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.cli import job_main, job_parser, parse_job_args  # noqa: E402
from puma.config import Config  # noqa: E402


@job_main
def main(argv: list[str] | None = None) -> int:
    """Parse, (embed,) evaluate, print the table and where the metrics went."""
    parser = job_parser(__doc__.splitlines()[0])
    parser.add_argument("--index", default="", help="index folder (local or s3://); default: index.uri")
    parser.add_argument("--out", default="", help="metrics JSON URI (default: <index>/evaluation.json)")
    parser.add_argument("--embed", action="store_true", help="embed the test split of data.uri first")
    parser.add_argument("--checkpoint", default="",
                        help="checkpoint to embed with (default: embed.checkpoint)")
    args, cfg = parse_job_args(parser, argv)
    if cfg is None:
        return 0
    from puma import storage
    from puma.eval.index_eval import metrics_table, run_evaluation
    from puma.index.layout import IndexFolder
    from puma.index.versions import live_manifest

    uri = args.index or cfg.index.uri
    storage.preflight(cfg.storage, outputs=[uri, args.out, cfg.data.uri])  # buckets, credentials
    out = args.out or IndexFolder(uri).evaluation
    if args.embed or live_manifest(uri) is None:
        uri = embed_test_split(cfg, uri, args.checkpoint)  # the checkpoint's version: it is what to evaluate
    metrics, out_uri = run_evaluation(uri, cfg.index, cfg.eval.ks, out, cfg.eval.query_chunk)
    print(metrics_table(metrics))
    print(f"[puma] evaluated {uri} (index.nprobe={cfg.index.nprobe})")
    print(f"[puma] metrics: {out_uri}")
    return 0


def embed_test_split(cfg: Config, uri: str, checkpoint: str) -> str:
    """Embed the test split of data.uri into the index at ``uri`` (jobs/embed.py's library call);
    returns the index written: the checkpoint model's version of the location."""
    from puma.inference import embed_catalogue

    report = embed_catalogue(cfg, cfg.data.uri, index_uri=uri, checkpoint=checkpoint or None, split="test",
                             settle=False)  # evaluating a model never changes which version is served
    print(f"[puma] embedded {report.embedded} test images of {cfg.data.uri} into {report.index_uri} "
          f"({report.skipped_indexed} already indexed, {report.rejected} rejected, "
          f"{report.total} in the index)")
    return report.index_uri


if __name__ == "__main__":
    raise SystemExit(main())
