"""The jobs' shared command line (puma/cli.py): options and ``key=value`` overrides in any order.

Users write `jobs/embed.py index.uri=X --catalogue Y embed.checkpoint=Z`; argparse's plain parse_args took
the positionals in one run and refused the override after the option ("unrecognized arguments").
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from puma.cli import job_parser, parse_job_args

REPO = Path(__file__).resolve().parent.parent
X, Y, Z = "/tmp/puma-cli/index", "/tmp/puma-cli/catalogue", "/tmp/puma-cli/checkpoint"


def embed_like_parser():
    """The shared options plus an append option and an option with a typed value, as jobs add them."""
    parser = job_parser("test")
    parser.add_argument("--catalogue", action="append", default=[])
    parser.add_argument("--k", type=int, default=10)
    return parser


@pytest.mark.parametrize("argv", [
    [f"index.uri={X}", f"embed.checkpoint={Z}", "--catalogue", Y, "--k", "3"],  # overrides first
    [f"index.uri={X}", "--catalogue", Y, f"embed.checkpoint={Z}", "--k", "3"],  # before, between, after
    ["--k", "3", f"index.uri={X}", "--catalogue", Y, f"embed.checkpoint={Z}"],
    ["--catalogue", Y, "--k=3", f"index.uri={X}", f"embed.checkpoint={Z}"],  # overrides last
    ["--catalogue", Y, "--k", "3", "--", f"index.uri={X}", f"embed.checkpoint={Z}"],  # after `--`
], ids=["overrides-first", "mixed", "option-first", "overrides-last", "after-double-dash"])
def test_options_and_overrides_in_any_order(argv):
    args, cfg = parse_job_args(embed_like_parser(), argv, model_checks=False)
    assert args.catalogue == [Y] and args.k == 3
    assert args.overrides == [f"index.uri={X}", f"embed.checkpoint={Z}"]
    assert (cfg.index.uri, cfg.embed.checkpoint) == (X, Z)


def test_an_option_value_that_looks_like_an_override_stays_the_options():
    args, cfg = parse_job_args(embed_like_parser(), ["embed.checkpoint=/a", "--catalogue", "x=y",
                                                     "embed.checkpoint=/b"], model_checks=False)
    assert args.catalogue == ["x=y"] and args.overrides == ["embed.checkpoint=/a", "embed.checkpoint=/b"]
    assert cfg.embed.checkpoint == "/b"  # the last override of a key wins, as before


def test_the_embed_job_takes_an_override_after_an_option():
    """The command of the issue: the overrides reach the config (the checkpoint named after --catalogue
    is the one refused), not an argparse error."""
    result = subprocess.run([sys.executable, "jobs/embed.py", f"index.uri={X}", "--catalogue", Y,
                             f"embed.checkpoint={Z}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "unrecognized arguments" not in result.stderr
    assert result.returncode == 2 and f"error: {Z} is not a complete PUMA checkpoint" in result.stderr


ENTRY_POINTS = sorted(f"jobs.{p.stem}" for p in (REPO / "jobs").glob("[a-z]*.py")) + ["tune.sweep"]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_job_imports_and_takes_overrides_around_its_options(module, capsys):
    """Each job is a module of the repository root (``jobs.embed.main(argv)``), and its own parser
    takes overrides before and after an option."""
    job = importlib.import_module(module)
    assert job.main(["train.epochs=5", "--print-config", "index.nprobe=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["train"]["epochs"], printed["index"]["nprobe"]) == (5, 7)


@pytest.fixture
def default_storage_after():
    """The process's storage settings back to the defaults after the test (as the s3_storage fixture does)."""
    from puma import storage
    from puma.config import StorageConfig

    yield
    storage.configure(StorageConfig())


def test_the_entry_point_makes_paths_absolute_and_configures_storage_once(tmp_path, monkeypatch,
                                                                           default_storage_after):
    """parse_job_args hands the job its config as this process works with it: relative paths from the
    working directory, storage configured with the config's settings; the library functions that call
    for_this_process again on it change nothing and keep the S3 clients made since."""
    from puma import storage
    from puma.config import for_this_process
    from puma.storage import settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(settings, "_configured", False)
    endpoint = "http://127.0.0.1:1"
    _, cfg = parse_job_args(embed_like_parser(), ["index.uri=idx", f"storage.endpoint_url={endpoint}",
                                                  "data.uri=s3://bucket/data"], model_checks=False)
    assert cfg.index.uri == str(tmp_path / "idx") and cfg.data.uri == "s3://bucket/data"
    assert storage.configured() and storage.s3_endpoint() == endpoint
    settings.fs_cache[("held",)] = "a client"  # as an S3 filesystem made since would be
    assert for_this_process(cfg) == cfg and settings.fs_cache == {("held",): "a client"}
    other = for_this_process(parse_job_args(embed_like_parser(), ["storage.endpoint_url=http://127.0.0.1:2"],
                                            model_checks=False)[1])
    assert storage.s3_endpoint() == "http://127.0.0.1:2" and settings.fs_cache == {}, other.storage


def test_new_credentials_in_the_environment_configure_storage_again(monkeypatch, default_storage_after):
    """A process that calls jobs one after another under other AWS credentials gets new S3 clients."""
    from puma import storage
    from puma.config import StorageConfig
    from puma.storage import settings

    settings_now = StorageConfig(endpoint_url="http://127.0.0.1:1")
    storage.configure_once(settings_now)
    settings.fs_cache[("held",)] = "a client"
    storage.configure_once(settings_now)
    assert settings.fs_cache == {("held",): "a client"}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone-else")
    storage.configure_once(settings_now)
    assert settings.fs_cache == {}
