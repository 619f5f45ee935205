"""Embed catalogues into the sharded index: `python jobs/embed.py (--catalogue URI ... | --watch PREFIX)`.

A catalogue is a prepared dataset (manifest.json), images under a folder / s3:// prefix, or a table
(.csv, .jsonl, .parquet with item_id, image_uri and optional label, dataset and other columns).
Every run reconciles: new items are embedded, items whose image changed are embedded again, items
gone from the catalogue are removed; unchanged images are not read. A re-run after a crash embeds
only what is missing. The checkpoint is embed.checkpoint ('' = <train.storage_path>/<train.run_name>/best);
a new model builds its own version of the index for every live catalogue, which then goes live
(jobs/index.py lists, promotes and rolls back versions).
Example: `python jobs/embed.py --catalogue artifacts/data/demo index.uri=artifacts/index/demo`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.cli import job_main, job_parser, parse_job_args  # noqa: E402


@job_main
def main(argv: list[str] | None = None) -> int:
    """Parse, embed each catalogue (or watch a prefix), print what was added and where."""
    parser = job_parser(__doc__.splitlines()[0])
    parser.add_argument("--catalogue", action="append", default=[], help="catalogue URI (repeatable)")
    parser.add_argument("--watch", default="",
                        help="reconcile every catalogue (sub-folder or table) under this prefix")
    args, cfg = parse_job_args(parser, argv, model_checks=False)  # the model is the checkpoint's
    if cfg is None:
        return 0
    if bool(args.catalogue) == bool(args.watch):
        print("error: give --catalogue URI (repeatable) or --watch PREFIX, not both", file=sys.stderr)
        return 2
    from puma import storage
    from puma.checkpoint import configured_checkpoint
    from puma.inference import watch
    from puma.inference.job import embed_catalogues

    storage.preflight(cfg.storage, inputs=[*args.catalogue, args.watch, configured_checkpoint(cfg),
                                           cfg.embed.backbone_weights], outputs=[cfg.index.uri])
    reports = watch(cfg, args.watch) if args.watch else embed_catalogues(cfg, args.catalogue)
    for report in reports:
        print(f"[puma] {report.summary()}")
        if report.rejected:
            print(f"[puma] {report.rejected} rejected image(s) listed in {report.rejects_uri}")
    promoted = [r.promoted for r in reports if r.promoted]
    if promoted:
        print(f"[puma] version {promoted[-1]} is live at {cfg.index.uri}")
    print(f"[puma] index: {cfg.index.uri if not reports else reports[0].index_uri} "
          f"({reports[-1].total if reports else 0} items); {len(reports)} catalogue(s)")
    return 1 if any(r.error for r in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
