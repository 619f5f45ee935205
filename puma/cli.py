"""The shared command line of every job: ``--config FILE`` plus dotted ``key=value`` overrides."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from puma.config import Config, ConfigError, dump_yaml, help_config_lines
from puma.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"


def job_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every job shares; jobs add their own."""
    parser = argparse.ArgumentParser(description=description,
                                     epilog="Overrides are dotted config keys, e.g. train.epochs=5 "
                                            "optim.lr=1e-4; --help-config lists every key.")
    parser.add_argument("--config", help="YAML config file (local path or s3://); default: "
                                         f"{DEMO_CONFIG.relative_to(REPO_ROOT)} (the embedded default)")
    parser.add_argument("--help-config", action="store_true",
                        help="list every config key with its type, default and description, and exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--verbose", action="store_true",
                        help="also show tracebacks of user errors, and library logs where a job has them")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    return parser


def resolve_config(args: argparse.Namespace) -> Config:
    """Defaults -> --config (or the demo config) -> overrides, then the method's own config checks."""
    from puma.methods import load_config  # torch and every method: not for --help / --help-config

    path = args.config or str(DEMO_CONFIG)
    return load_config(path, args.overrides)


def parse_job_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace,
                                                                                     Config | None]:
    """Parse argv; returns (args, None) when the job should exit early (help printed, bad config)."""
    args = parser.parse_args(argv)
    if args.help_config:
        print("\n".join(help_config_lines()))
        return args, None
    try:
        cfg = resolve_config(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if args.print_config:
        print(dump_yaml(cfg))
        return args, None
    return args, cfg


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (newlines folded), never empty."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def run_job(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a job's ``main``: a UserError prints ``error: <message>`` on one line and gives exit code 2
    (its traceback too with --verbose); any other exception is internal: exit 1 with the traceback."""
    args = sys.argv[1:] if argv is None else argv
    try:
        return main(argv)
    except UserError as exc:
        if "--verbose" in args:
            traceback.print_exc()
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
