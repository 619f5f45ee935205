"""Embed catalogues into the sharded index: `python jobs/embed.py (--catalogue URI ... | --watch PREFIX)`.

A catalogue is a prepared dataset (manifest.json) or images under a folder / s3:// prefix. Items
already in the index are skipped, so a re-run after a crash, or a new catalogue, embeds only what
is missing. The checkpoint is embed.checkpoint ('' = <train.storage_path>/<train.run_name>/best).
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
    parser.add_argument("--watch", default="", help="embed every catalogue under this prefix not indexed yet")
    args, cfg = parse_job_args(parser, argv)
    if cfg is None:
        return 0
    if bool(args.catalogue) == bool(args.watch):
        print("error: give --catalogue URI (repeatable) or --watch PREFIX, not both", file=sys.stderr)
        return 2
    from puma import storage
    from puma.inference import embed_catalogue, resolve_checkpoint, watch

    storage.preflight(cfg.storage, inputs=[*args.catalogue, args.watch, resolve_checkpoint(cfg),
                                           cfg.embed.backbone_weights], outputs=[cfg.index.uri])
    reports = watch(cfg, args.watch) if args.watch else [embed_catalogue(cfg, c) for c in args.catalogue]
    for report in reports:
        print(f"[puma] {report.summary()}")
        if report.rejected:
            print(f"[puma] {report.rejected} rejected image(s) listed in {report.rejects_uri}")
    print(f"[puma] index: {cfg.index.uri if not reports else reports[0].index_uri} "
          f"({reports[-1].total if reports else 0} items); {len(reports)} catalogue(s)")
    return 1 if any(r.error for r in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
