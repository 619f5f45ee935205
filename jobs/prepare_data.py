"""Prepare datasets as Parquet shards + manifest: `python jobs/prepare_data.py [--preset P] [--source R]`.

Examples:
  python jobs/prepare_data.py                                   # the demo preset -> data.uri
  python jobs/prepare_data.py --preset cub --source /raw/CUB_200_2011 --out s3://bucket/puma/cub
  python jobs/prepare_data.py --preset paper --source cub=/raw/CUB_200_2011 --source cars=/raw/cars ...
  python jobs/prepare_data.py --preset folder --source /raw/products --name products --class-depth 1
  python jobs/prepare_data.py --preset folder --source /raw/catalogue --class-depth 0   # no labels
  python jobs/prepare_data.py --preset table --source items.csv --name shop   # item_id,image_uri[,label]
Tables (.csv, .jsonl, .parquet) name each item's image (relative to the table, absolute, or s3://);
without labels they prepare an unlabeled catalogue; rows without an item_id or image_uri, or with a
repeated item_id, are listed in <out>/rejects/prepare.jsonl.
Re-running with the same inputs writes nothing (shards are content-addressed); S3 settings come
from storage.* keys and credentials from the standard AWS chain.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.cli import job_main, job_parser, parse_job_args  # noqa: E402

PRESETS = "demo|cub|cars|sop|inshop|nabirds|dogs|flowers|aircraft|folder|table|paper"


def build_parser():
    """The shared job options plus what to prepare and where."""
    parser = job_parser(__doc__.splitlines()[0])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n".join(__doc__.splitlines()[2:]) + "\n" + parser.epilog
    parser.add_argument("--preset", default=None,
                        help=f"{PRESETS}; comma-separate several (default: data.preset)")
    parser.add_argument("--source", action="append", default=[], metavar="[PRESET=]ROOT",
                        help="release root, or table file for --preset table (local path or s3://); "
                             "PRESET=ROOT once per preset when several")
    parser.add_argument("--out", default=None, help="output URI (default: data.uri)")
    parser.add_argument("--name", default="",
                        help="dataset name for --preset folder or table (default: the root's name, "
                             "or the table's file name without its suffix)")
    parser.add_argument("--class-depth", type=int, default=1,
                        help="folder layout: folders that name a class; 0: an unlabeled catalogue "
                             "(every image, no labels; trains with model.method=udml_ss)")
    parser.add_argument("--verify", action="store_true", help="re-read every shard and check its sha256")
    return parser


@job_main
def main(argv: list[str] | None = None) -> int:
    """Convert, write shards and manifest, print where they went and the per-dataset counts."""
    args, cfg = parse_job_args(build_parser(), argv)
    if cfg is None:
        return 0
    from puma import storage
    from puma.data.prepare import job_specs, prepare, print_report

    preset = args.preset or cfg.data.preset or "demo"
    out = args.out or cfg.data.uri
    specs = job_specs(cfg, preset, args.source, args.name, args.class_depth)
    storage.preflight(cfg.storage, inputs=[s.uri for s in specs], outputs=[out])
    report = prepare(specs, out, cfg.data.shard_rows, preset=preset, max_side=cfg.data.prepare_max_side)
    return print_report(report, verify=args.verify)


if __name__ == "__main__":
    raise SystemExit(main())
