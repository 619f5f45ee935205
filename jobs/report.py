"""Visual evaluation report of a run: `python jobs/report.py [--compare RUN] [--sweep DIR] [key=value ...]`.

Evaluates the run's checkpoint (--checkpoint; default embed.checkpoint, else
<train.storage_path>/<train.run_name>/best) through the index at --index (default index.uri; the
test split of data.uri is embedded into it first when there is no index yet), exactly as
jobs/evaluate.py, and writes one HTML page with its PNGs and report.json to --out (default
<run folder>/report): R@1 / MAP@R bars (zero-shot, this run, --compare runs), training curves,
retrieval grids, t-SNE maps, the prompt pool's weights, the --sweep keep-probability curve and the
few-shot curve. Example: `python jobs/report.py --compare artifacts/runs/lr-linear`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.cli import REPO_ROOT, job_main, job_parser, parse_job_args  # noqa: E402

FEWSHOT = REPO_ROOT / "bench" / "results" / "fewshot.json"


@job_main
def main(argv: list[str] | None = None) -> int:
    """Parse, build the report, print the metrics and where the page went."""
    parser = job_parser(__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="",
                        help="checkpoint to report on (default: embed.checkpoint, else <run>/best)")
    parser.add_argument("--index", default="", help="index folder (local or s3://); default: index.uri")
    parser.add_argument("--compare", action="append", default=[], metavar="RUN_URI",
                        help="another run folder to compare with (repeatable; its best checkpoint's metrics)")
    parser.add_argument("--sweep", default="", help="a sweep's results folder (trials.csv): keep-prob curve")
    parser.add_argument("--fewshot", default=str(FEWSHOT),
                        help="few-shot results JSON (default: bench/results/fewshot.json; skipped if absent)")
    parser.add_argument("--out", default="", help="report folder (default: <run folder>/report)")
    parser.add_argument("--queries", type=int, default=4, help="retrieval grid rows per dataset (default 4)")
    parser.add_argument("--k", type=int, default=6, help="results per grid row (default 6)")
    parser.add_argument("--tsne-points", type=int, default=1500,
                        help="points of the t-SNE map (default 1500)")
    args, cfg = parse_job_args(parser, argv)
    if cfg is None:
        return 0
    from puma import storage
    from puma.eval.index_eval import metrics_table
    from puma.report import ReportOptions, build_report

    options = ReportOptions(checkpoint=args.checkpoint, index=args.index, compare=args.compare,
                            sweep=args.sweep, out=args.out, fewshot=args.fewshot, queries=args.queries,
                            k=args.k, tsne_points=args.tsne_points)
    storage.preflight(cfg.storage, inputs=[args.checkpoint, *args.compare, args.sweep],  # before Ray
                      outputs=[args.index or cfg.index.uri, args.out, args.fewshot, cfg.data.uri,
                               cfg.train.storage_path])
    outcome = build_report(cfg, options)
    print(metrics_table(outcome.metrics))
    print(f"[puma] evaluated {outcome.evaluation.index} ({outcome.evaluation.items} items)")
    print(f"[puma] report: {outcome.page} ({len(outcome.files)} files in {outcome.out})")
    print(f"[puma] metrics: {outcome.record}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
