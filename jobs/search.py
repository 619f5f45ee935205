"""Search a sharded FAISS index: `python jobs/search.py (--queries F | --item-id ID | --image F) [key=value]`.

Queries are stored vectors (.npy (Q, E) or an embeddings Parquet), item ids already in the index, or
image files (local or s3://) embedded with a checkpoint's model (--checkpoint; default
<train.storage_path>/<train.run_name>/best); every shard is searched and the top-k merged. Results
(query, rank, item_id, score) go to a Parquet file; --grid also draws the queries and results as a
PNG (matches framed green, non-matches red when labels are known).
Example: `python jobs/search.py --item-id cub/0001 --k 5 --grid /tmp/grid.png index.uri=artifacts/index/demo`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.cli import job_main, job_parser, parse_job_args  # noqa: E402


@job_main
def main(argv: list[str] | None = None) -> int:
    """Parse, search, print the top results and where they went."""
    parser = job_parser(__doc__.splitlines()[0])
    parser.add_argument("--queries", default="", help="query vectors: .npy (Q, E) or embeddings Parquet")
    parser.add_argument("--item-id", action="append", default=[], help="an indexed item id (repeatable)")
    parser.add_argument("--image", action="append", default=[], help="a query image file (repeatable)")
    parser.add_argument("--checkpoint", default="",
                        help="checkpoint that embeds --image queries (default: the one the live index "
                             "version records, else <train.storage_path>/<train.run_name>/best)")
    parser.add_argument("--grid", default="", help="also write a retrieval grid PNG here (local or s3://)")
    parser.add_argument("--k", type=int, default=10, help="neighbours per query (default 10)")
    parser.add_argument("--out", default="", help="results Parquet URI (default artifacts/search/...)")
    parser.add_argument("--include-self", action="store_true", help="keep an item id query in its results")
    parser.add_argument("--filter", default="", help='only items matching this metadata filter (JSON), e.g. '
                        '\'{"and": [{"category": "boots"}, {"price": {"lt": 50}}]}\'')
    parser.add_argument("--filter-file", default="", help="the --filter JSON read from this file (local or s3://)")
    parser.add_argument("--verify", action="store_true", help="verify checksums and counts first")
    args, cfg = parse_job_args(parser, argv)
    if cfg is None:
        return 0
    from puma import storage
    from puma.checkpoint import best_checkpoint_uri
    from puma.errors import UserError
    from puma.index import verify
    from puma.index.filters import parse_filter
    from puma.index.versions import recorded_checkpoint, resolve
    from puma.inference.search import run_search

    checkpoint = args.checkpoint or (recorded_checkpoint(cfg.index.uri) if args.image else "") or \
        best_checkpoint_uri(cfg)
    storage.preflight(cfg.storage, inputs=[cfg.index.uri, args.queries, *args.image, args.filter_file,
                                           checkpoint if args.image else ""], outputs=[args.out, args.grid])
    if args.verify:
        report = verify(resolve(cfg.index.uri)).raise_if_bad()
        print(f"[puma] verified {report.uri}: {report.items} items, {report.shards} shards, "
              f"{report.files_checked} files")
    if args.filter and args.filter_file:
        raise UserError("give --filter or --filter-file, not both")
    text = storage.read_bytes(args.filter_file).decode() if args.filter_file else args.filter
    where = parse_filter(text) if text.strip() else None
    outcome = run_search(cfg.index, args.k, args.queries, args.item_id, args.out, args.include_self,
                         args.image, checkpoint, args.grid, where)
    shown = outcome.results.slice(0, min(len(outcome.results), 3 * outcome.k))  # the first three queries
    print(shown.to_pandas().to_string(index=False))
    if outcome.k_limit:
        print(f"[puma] --k {args.k}: {outcome.k} results per query ({outcome.k_limit})")
    print(f"[puma] searched {outcome.index_items} items, {outcome.index_shards} shard(s): {cfg.index.uri}"
          + (f", filter {where.key}" if where is not None else ""))
    print(f"[puma] results: {outcome.out_uri}")
    if outcome.grid_uri:
        print(f"[puma] retrieval grid: {outcome.grid_uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
