"""The shared command line of every job: ``--config FILE`` plus dotted ``key=value`` overrides, in any
order with the job's options (``index.uri=X --catalogue Y embed.checkpoint=Z``)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from puma import console, storage
from puma.config import Config, dump_yaml, for_this_process, help_config_lines
from puma.errors import one_line, user_error

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"
CONFIG_ENV = "PUMA_CONFIG"  # the config a job reads when no --config is given (a site's own default)


def default_config() -> str:
    """The config of a job run without --config: $PUMA_CONFIG when set, else the embedded default."""
    return os.environ.get(CONFIG_ENV) or str(DEMO_CONFIG)


def job_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every job shares; jobs add their own."""
    parser = argparse.ArgumentParser(description=description,
                                     epilog="Overrides are dotted config keys, e.g. train.epochs=5 "
                                            "optim.lr=1e-4; --help-config lists every key.")
    parser.add_argument("--config", help=f"YAML config file (local path or s3://); default: ${CONFIG_ENV} "
                                         f"when set, else {DEMO_CONFIG.relative_to(REPO_ROOT)} "
                                         "(the embedded default)")
    parser.add_argument("--help-config", action="store_true",
                        help="list every config key with its type, default and description, and exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--verbose", action="store_true",
                        help="also show Ray's own logs and warnings, and the traceback of an error")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse argv with options and ``key=value`` overrides intermixed in any order: argparse's plain
    parse_args takes the positionals in one run, so an override after an option was refused."""
    return parser.parse_intermixed_args(argv)


def resolve_config(args: argparse.Namespace, model_checks: bool = True) -> Config:
    """Defaults -> --config (or $PUMA_CONFIG, or the demo config) -> overrides, then (``model_checks``)
    the method's own config checks. A job whose model comes from a checkpoint's own config (embedding,
    serving) leaves them out: they import torch and every method, seconds of a run that embeds nothing."""
    if not model_checks:
        from puma.config import load_config

        return load_config(args.config or default_config(), args.overrides)
    from puma.methods import load_config  # torch and every method: not for --help / --help-config

    return load_config(args.config or default_config(), args.overrides)


def parse_job_args(parser: argparse.ArgumentParser, argv: list[str] | None, model_checks: bool = True,
                   as_given: bool = False) -> tuple[argparse.Namespace, Config | None]:
    """Parse argv; returns (args, None) when the job should exit early (help printed, bad config), else
    the config as this process works with it (``for_this_process``: absolute paths, storage configured).
    ``model_checks``: run the configured method's checks (see resolve_config). ``as_given``: the config
    as the command line gave it, relative paths kept, for a job that writes it out again (the sweep's
    best_config.yaml must run where the user runs jobs/train.py); that job resolves it itself."""
    args = parse_command_line(parser, argv)
    console.set_verbose(args.verbose)
    if args.help_config:
        print("\n".join(help_config_lines()))
        return args, None
    cfg = resolve_config(args, model_checks)  # a bad config or a missing file: a UserError, one line
    if args.print_config:
        print(dump_yaml(cfg))
        return args, None
    return args, cfg if as_given else for_this_process(cfg)  # once per process, here


def run_job(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a job's ``main``: a user's error (a UserError, also one raised in a Ray worker, a missing
    file, a full disk) prints ``error: <message>`` on one line and gives exit code 2 (its traceback
    too with --verbose); any other exception is internal: exit 1 with the traceback."""
    args = sys.argv[1:] if argv is None else argv
    console.set_verbose("--verbose" in args)
    try:
        return main(argv)
    except BrokenPipeError:  # the reader went away (`--help-config | head`): no traceback, like other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit fails too
        return 0
    except Exception as exc:
        found = user_error(exc)
        if found is None:
            raise
        if "--verbose" in args:
            traceback.print_exc()
        print(f"error: {storage.redact(one_line(found))}", file=sys.stderr, flush=True)
        return 2


def job_main(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Decorate a job's ``main(argv)`` so that every call (the command line, a test) goes through run_job."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        return run_job(main, argv)

    return run
