"""Config descriptions come from the dataclass source (so ``--help-config`` cannot drift), every key
has one, and keys renamed since configs were first saved still load."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from puma.cli import CONFIG_ENV, job_parser, parse_job_args, resolve_config
from puma.config import (
    Config,
    ConfigError,
    StorageConfig,
    describe_keys,
    field_docs,
    from_dict,
    load_config,
    to_dict,
    valid_keys,
)


def test_every_config_key_has_a_description():
    described = {key: doc for key, _, _, doc in describe_keys()}
    assert list(described) == list(valid_keys())  # every leaf key, in declaration order
    missing = [key for key, doc in described.items() if len(doc) < 8]
    assert not missing, f"give these fields a trailing comment (their --help-config line): {missing}"


@dataclasses.dataclass
class _Example:
    plain: int = 1  # one line
    spread: str = "x"  # a description that goes on
    # on the next line
    bare: float = 0.5

    def method(self) -> None:  # not a field
        pass


def test_descriptions_are_the_trailing_comments_continued_below():
    assert field_docs(_Example) == {"plain": "one line", "bare": "",
                                    "spread": "a description that goes on on the next line"}


def test_help_config_prints_type_default_and_description(capsys):
    args, cfg = parse_job_args(job_parser("test"), ["--help-config"])
    assert cfg is None and args.help_config
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(valid_keys())
    assert ("storage.retry.max_elapsed_s (float, default 10.0): no retry starts after this many seconds: how "
            "soon a dead endpoint is reported; raise it to ride out longer outages") in lines
    assert "model.adapter.blocks (list[int] | null, default null): " in "\n".join(lines)


def test_a_renamed_key_still_loads_from_saved_configs_files_and_overrides(tmp_path):
    saved = to_dict(Config())
    del saved["storage"]["retry"]
    saved["storage"]["retries"] = 2  # as configs saved before storage.retry existed
    assert from_dict(saved).storage.retry.max_attempts == 3  # retries after the first -> attempts in all
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"storage": {"retries": 4}}))
    assert load_config(path).storage.retry.max_attempts == 5
    assert load_config(None, ["storage.retries=0"]).storage.retry.max_attempts == 1


@pytest.mark.parametrize("endpoint", ["127.0.0.1:8333", "minio.internal:9000", "http://"])
def test_an_endpoint_must_be_a_url(endpoint):
    with pytest.raises(ConfigError, match=r"storage.endpoint_url="):
        StorageConfig(endpoint_url=endpoint)
    assert StorageConfig(endpoint_url="https://s3.example.com").endpoint_url == "https://s3.example.com"


def test_puma_config_is_the_default_config_and_config_still_wins(tmp_path, monkeypatch):
    site, other = tmp_path / "site.yaml", tmp_path / "other.yaml"
    site.write_text("train: {epochs: 7}\n")
    other.write_text("train: {epochs: 9}\n")
    parser = job_parser("t")
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert resolve_config(parser.parse_args([])).train.epochs == 3  # configs/demo.yaml
    monkeypatch.setenv(CONFIG_ENV, str(site))
    assert resolve_config(parser.parse_args([])).train.epochs == 7
    assert resolve_config(parser.parse_args(["train.epochs=8"])).train.epochs == 8
    assert resolve_config(parser.parse_args(["--config", str(other)])).train.epochs == 9


def test_help_config_into_a_reader_that_stops_early_ends_quietly():
    """`jobs/train.py --help-config | head`: what the reader no longer takes goes nowhere, exit 0, no
    BrokenPipeError traceback (the pipe is closed before the job writes a line)."""
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "jobs/train.py", "--help-config"], cwd=repo, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
