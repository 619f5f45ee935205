"""Object storage as users meet it through the jobs, against the real S3 server (SeaweedFS): every
storage failure a user can fix prints one line and exits 2 before Ray starts, fast; a prepare from
S3 lists a truncated JPEG once.

In-process runs go through ``puma.cli.run_job`` (what ``python jobs/X.py`` does) with Ray's start
replaced by a failure (failure injection: the test fails if a job gets that far); the dead-endpoint
probe runs the real command line in a subprocess.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import AWS_TEST_ENV, encode_image, write_cub_tree
from s3proxy import S3Proxy

import puma.runtime
from puma import storage
from puma.cli import run_job
from puma.data.rejects import read_rejects

REPO = Path(__file__).resolve().parent.parent


def _job(name: str):
    return importlib.import_module(f"tune.{name}" if name == "sweep" else f"jobs.{name}").main


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray fails the test: these errors must come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("a job started Ray before reporting a storage error")

    monkeypatch.setattr(puma.runtime, "init_ray", refuse)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, **AWS_TEST_ENV}
    env.pop("AWS_ENDPOINT_URL", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    return proc, time.monotonic() - start


def test_server_down_is_one_line_exit_2_within_seconds_before_ray(aws_test_env, tmp_path):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    base, baseline = _run(["jobs/train.py", "--print-config"])  # start-up cost (imports), same load
    assert base.returncode == 0
    proc, seconds = _run(["jobs/train.py", f"storage.endpoint_url={endpoint}",
                          "train.storage_path=s3://puma-test/runs", f"data.uri={tmp_path / 'data'}"])
    assert proc.returncode == 2 and "[puma] Ray" not in proc.stdout, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checking s3://puma-test/runs failed: cannot reach "
                                                   f"endpoint {endpoint}"), proc.stderr
    retried = float(re.search(r"attempts in ([\d.]+) s", lines[0]).group(1))
    assert retried < 10.0 and seconds - baseline < 20.0, (retried, seconds, baseline)  # no Ray, one layer


def test_wrong_secret_key_is_one_line_after_one_request(s3_server, s3_storage, no_ray, monkeypatch, capsys):
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    proxy = S3Proxy((host, int(port))).start()  # counts requests
    try:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        code = run_job(_job("embed"), ["--catalogue", storage.join(s3_storage, "cat"),
                                       f"storage.endpoint_url={proxy.endpoint}",
                                       f"index.uri={storage.join(s3_storage, 'index')}"])
    finally:
        proxy.stop()
    line = _one_line_error(capsys)
    assert code == 2 and len(proxy.log) == 1  # refused once, never retried
    assert (f"error: checking {storage.join(s3_storage, 'cat')} failed: endpoint {proxy.endpoint} refused "
            "the credentials (SignatureDoesNotMatch, HTTP 403; credentials from the environment)") in line
    assert "not-the-secret" not in line


def test_missing_bucket_is_one_line_and_verbose_adds_the_traceback(s3_server, s3_storage, no_ray, capsys,
                                                                   tmp_path):
    args = [f"storage.endpoint_url={s3_server.endpoint}", "train.storage_path=s3://no-such-bucket-23/runs",
            f"data.uri={tmp_path / 'data'}"]
    assert run_job(_job("train"), args) == 2
    line = _one_line_error(capsys)
    assert line == (f"error: checking s3://no-such-bucket-23/runs failed: bucket 'no-such-bucket-23' does "
                    f"not exist at endpoint {s3_server.endpoint}; create it (aws s3 mb "
                    f"s3://no-such-bucket-23 --endpoint-url {s3_server.endpoint}) or fix the URI")
    assert run_job(_job("train"), [*args, "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == line


def test_endpoint_without_scheme_is_a_config_error(s3_server, no_ray, capsys, tmp_path):
    host_port = s3_server.endpoint.removeprefix("http://")
    for job, args in (("prepare_data", ["--preset", "cub", "--source", "s3://puma-test/raw"]),
                      ("embed", ["--catalogue", "s3://puma-test/cat"])):
        assert run_job(_job(job), [*args, f"storage.endpoint_url={host_port}"]) == 2
        assert _one_line_error(capsys) == (f"error: storage.endpoint_url='{host_port}' has no scheme: "
                                           f"write http://{host_port} for a server without TLS (a local "
                                           f"SeaweedFS or MinIO) or https://{host_port}")


def test_prepare_from_s3_lists_a_truncated_jpeg_once(s3_server, s3_storage, capsys, tmp_path):
    full = encode_image(size=(96, 80), seed=3)
    kinds = write_cub_tree(tmp_path / "raw", num_classes=2, per_class=3,
                           special={"cut": full[: len(full) // 2]})
    raw = storage.join(s3_storage, "raw")
    for path in sorted(p for p in (tmp_path / "raw").rglob("*") if p.is_file()):
        storage.write_bytes(storage.join(raw, *path.relative_to(tmp_path / "raw").parts), path.read_bytes())
    out = storage.join(s3_storage, "prepared")
    args = ["--preset", "cub", "--source", raw, "--out", out, f"storage.endpoint_url={s3_server.endpoint}"]
    assert run_job(_job("prepare_data"), args) == 0
    printed = capsys.readouterr().out
    rejects_uri = storage.join(out, "rejects", "prepare.jsonl")
    assert f"[puma.data] rejects:  1 {{'truncated': 1}} -> {rejects_uri}" in printed
    (row,) = read_rejects(rejects_uri)
    assert (row["item_id"], row["reason"], row["stage"]) == ("cub/images/002.Class_2/cut.jpg", "truncated",
                                                             "prepare")
    assert row["source_path"] == storage.join(raw, "images", "002.Class_2", "cut.jpg")
    assert sum(1 for k in kinds.values() if k == "good") == 6
    assert run_job(_job("prepare_data"), args) == 0  # a re-run writes nothing
    assert "(0 written, 2 unchanged, 0 stale deleted)" in capsys.readouterr().out
