"""Manage an index location: `python jobs/index.py (versions | promote | rollback | remove-catalogue | compact
| verify) [options] [key=value ...]`.

index.uri holds one version per model (puma.index.versions) and an alias naming the live one:
  versions                       list the versions, their models, items and catalogues; which is live
  promote --version NAME         make a version live (it must hold every live catalogue and verify)
  rollback                       make the previous version live again
  remove-catalogue --catalogue URI
                                 remove every item of a catalogue (all versions), then compact
  compact                        rewrite shards whose removed rows reach index.compact_fraction
  verify                         check every file of the live version against its manifest
A service (jobs/serve.py) follows a promote or a rollback within serve.watch_interval_s, without a restart.
Example: `python jobs/index.py rollback index.uri=s3://bucket/puma/index`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from puma.cli import job_main, job_parser, parse_job_args  # noqa: E402

ACTIONS = ("versions", "promote", "rollback", "remove-catalogue", "compact", "verify")


def build_parser() -> argparse.ArgumentParser:
    parser = job_parser(__doc__.splitlines()[0])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n".join(__doc__.splitlines()[2:]) + "\n" + parser.epilog
    parser.usage = "index.py {" + ",".join(ACTIONS) + "} [options] [key=value ...]"
    parser.add_argument("--version", default="", help="promote: the version to make live")
    parser.add_argument("--catalogue", default="", help="remove-catalogue: the catalogue URI, as embedded")
    return parser


@job_main
def main(argv: list[str] | None = None) -> int:
    """Parse, run the action on index.uri, print what it did."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    action = argv.pop(0) if argv and argv[0] in ACTIONS else ""
    args, cfg = parse_job_args(parser, argv)
    if cfg is None:
        return 0
    if not action:
        print(f"error: give the action first: one of {', '.join(ACTIONS)}", file=sys.stderr)
        return 2
    args.action = action
    needs = {"promote": args.version, "remove-catalogue": args.catalogue}
    if args.action in needs and not needs[args.action]:
        flag = "--version NAME" if args.action == "promote" else "--catalogue URI"
        print(f"error: {args.action} needs {flag}", file=sys.stderr)
        return 2
    from puma import storage

    storage.preflight(cfg.storage, inputs=[cfg.index.uri])
    return ACTION_FUNCTIONS[args.action](cfg, args)


def _versions(cfg, args) -> int:
    from puma.index.versions import is_legacy, list_versions

    location = cfg.index.uri
    if is_legacy(location):
        print(f"[puma] {location} is one index without versions (written before versions existed)")
        return 0
    for v in list_versions(location):
        mark = "live" if v.live else "previous" if v.previous else ""
        print(f"{v.name:20s} {mark:8s} {v.items:8d} items  {len(v.catalogues)} catalogue(s)  "
              f"model {v.model_id}  "
              f"updated {v.updated}")
    return 0


def _promote(cfg, args) -> int:
    from puma.index.versions import promote

    alias = promote(cfg.index.uri, args.version, keep=cfg.index.keep_versions)
    print(f"[puma] live: {alias.live} (previous: {alias.previous or 'none'}) at {cfg.index.uri}")
    return 0


def _rollback(cfg, args) -> int:
    from puma.index.versions import rollback

    alias = rollback(cfg.index.uri)
    print(f"[puma] rolled back: live {alias.live} (previous: {alias.previous}) at {cfg.index.uri}")
    return 0


def _remove_catalogue(cfg, args) -> int:
    from puma.inference.job import remove_catalogue

    for record in remove_catalogue(cfg, args.catalogue):
        print(f"[puma] {record['index']}: removed {record['removed']} item(s) of {record['catalogue']}, "
              f"{len(record['compacted'])} shard(s) compacted; {record['total']} items left")
    return 0


def _compact(cfg, args) -> int:
    from puma.index.build import compact
    from puma.index.versions import resolve

    uri = resolve(cfg.index.uri)
    done = compact(uri, cfg.index.compact_fraction)
    print(f"[puma] {uri}: {len(done.dropped)} shard(s) compacted into {len(done.shards)}; {done.total} items")
    return 0


def _verify(cfg, args) -> int:
    from puma.index import verify
    from puma.index.versions import resolve

    report = verify(resolve(cfg.index.uri))
    for problem in report.problems:
        print(f"[puma] problem: {problem}")
    print(f"[puma] {report.uri}: {report.items} items, {report.shards} shards, "
          f"{report.files_checked} files checked, "
          f"{'ok' if report.ok else f'{len(report.problems)} problem(s)'}")
    return 0 if report.ok else 1


ACTION_FUNCTIONS = {"versions": _versions, "promote": _promote, "rollback": _rollback,
                    "remove-catalogue": _remove_catalogue, "compact": _compact, "verify": _verify}


if __name__ == "__main__":
    raise SystemExit(main())
