"""The quick starts of the README and the guide, run as written (tests/quickstart.py): the README's command
trains the embedded default and its console holds our lines once and none of Ray's own; the getting
started page's next steps, the export page's and the object-storage walk-through run in a scratch checkout
and leave what they say they leave. A page that loses a marked block fails here, not silently."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import _is_free
from quickstart import REPO, Checkout, Result, quickstarts

README = quickstarts("README.md")
GUIDE = quickstarts("docs/getting-started.md")
EXPORT = quickstarts("docs/export.md")
DATA = quickstarts("docs/data.md")
RAY_NOISE = re.compile(r"\b(INFO|WARNING|WARN|ERROR|DEBUG)\b|pid=|\(raylet\)|Ray deduplicates|Progress bars|"
                       r"Deprecat|Warning:|Traceback|faiss|Execution plan|Dataset |Checkpoint successfully")
S3_DIR = Path("/tmp/puma-s3")  # the walk-through's server folder


def test_every_page_keeps_its_marked_quick_starts():
    assert set(README) == {"readme"} and set(GUIDE) == {"readme", "first-steps"}, (README, GUIDE)
    assert set(EXPORT) == {"export"} and set(DATA) == {"object-storage"}, (EXPORT, DATA)
    assert GUIDE["readme"] == README["readme"], "getting started shows the README's own command"
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == "bash scripts/test.sh" and "\nbash scripts/test.sh" in (REPO / "README.md").read_text()


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Checkout:
    return Checkout(tmp_path_factory.mktemp("quickstart"))


@pytest.fixture(scope="module")
def trained(checkout) -> tuple[Checkout, Result]:
    """The README's first command, once: set-up, then the embedded default (with the tiny model)."""
    return checkout, checkout.run(README["readme"])


def _job_lines(result: Result) -> list[str]:
    """The training job's own console: from its first line on (scripts/setup.sh prints before it)."""
    lines = result.lines()
    first = next((n for n, line in enumerate(lines) if line.startswith("[puma] Ray: ")), None)
    assert first is not None, result.output[-4000:]
    return lines[first:]


# the set-up check and one jobs/train.py run with its own local Ray, then a resume with --verbose
# (59 s alone; 225-300 s under two workers here, 252 s on CI)
@pytest.mark.budget(360)
def test_the_readme_command_trains_the_default_with_our_lines_once_and_no_ray_noise(trained):
    checkout, result = trained
    assert result.returncode == 0, result.output[-4000:]
    lines = _job_lines(result)
    text = "\n".join(lines)
    repeated = {line: n for line, n in Counter(lines).items() if n > 1}
    assert not repeated, f"lines printed more than once: {repeated}"
    noise = [line for line in lines if RAY_NOISE.search(line)]
    assert not noise, f"Ray's own output on the console: {noise[:10]}"
    table = [line.split()[0] for line in lines if not line.startswith("[puma")]
    assert table[0] == "dataset" and table[-2:] == ["unified", "harmonic"], text
    assert {"cub", "flowers", "omniglot"} <= set(table), text  # the demo's folders (+ Fashion-MNIST)
    for stage in ("evaluation (frozen backbone)", "epoch 1/1", "evaluation after epoch 1"):
        finals = [line for line in lines if line.startswith(f"[puma] {stage}: ") and " in " in line]
        assert len(finals) == 1, (stage, text)
    assert re.search(r"^\[puma\] epoch 1/1: (\d+)/\1 steps, [\d.]+ img/s, in (\d+m)?\d+s, loss \d+\.\d{4}$",
                     text, re.M), text
    assert sum(line.startswith("[puma] before training (frozen backbone): ") for line in lines) == 1
    assert re.match(r"\[puma\] Ray: local Ray \(\d+ logical CPUs\); Ray's own logs: /tmp/ray", lines[0]), text
    assert (checkout.path / "artifacts" / "runs" / "demo" / "best" / "current.json").is_file()

    verbose = checkout.run(".venv/bin/python jobs/train.py --verbose")  # resumes the finished run
    assert verbose.returncode == 0, verbose.output[-4000:]
    assert any("pid=" in line for line in verbose.lines()), "--verbose shows the workers' own output"
    assert any("Started a local Ray instance" in line for line in verbose.lines()), "and Ray's driver logs"
    ours = [line for line in verbose.lines() if line.startswith("[puma") and "Ray:" not in line]
    assert ours and not [line for line, n in Counter(ours).items() if n > 1], ours
    resumed = [line for line in verbose.lines() if line.startswith("[puma] resumed from ")]
    assert len(resumed) == 1, verbose.output[-4000:]


def _run_after_training(trained: tuple[Checkout, Result], block: str) -> Checkout:
    """Run ``block`` in the checkout the README's command trained in; both must succeed."""
    checkout, train = trained
    assert train.returncode == 0, train.output[-2000:]
    result = checkout.run(block)
    assert result.returncode == 0, result.output[-4000:]
    return checkout


@pytest.mark.budget(220)  # evaluate, search, report: three jobs (28 s alone; 95-151 s under two workers)
def test_getting_started_evaluates_searches_and_reports_the_trained_run(trained):
    checkout = _run_after_training(trained, GUIDE["first-steps"])
    index = checkout.path / "artifacts" / "index" / "demo"
    metrics = json.loads((index / "evaluation.json").read_text())
    assert 0 < metrics["metrics"]["harmonic/r@1"] <= 1 and metrics["items"] > 0, metrics
    grid = checkout.path / "artifacts" / "grid.png"
    assert grid.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = checkout.path / "artifacts" / "runs" / "demo" / "report" / "index.html"
    assert "harmonic" in report.read_text()


def test_the_export_quick_start_writes_a_model_onnx_runtime_embeds_with(trained):
    checkout = _run_after_training(trained, EXPORT["export"])
    model = checkout.path / "artifacts" / "export" / "demo.onnx"
    meta = ort.InferenceSession(str(model)).get_modelmeta().custom_metadata_map
    vectors = np.load(checkout.path / "embeddings.npy")  # the example writes to the current folder
    assert vectors.shape[1] == int(meta["puma.embed_dim"]) == 16 and len(vectors) >= 2
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)


def _wait_for_free(ports: list[int], seconds: float = 60) -> None:
    """The walk-through's server takes SeaweedFS's default ports; a Ray worker of another test may hold
    one of them (Ray's worker ports span 10002-19999) for a while."""
    deadline = time.monotonic() + seconds
    while True:
        busy = [port for port in ports if not _is_free(port, reuse_addr=True)]
        if not busy:
            return
        assert time.monotonic() < deadline, f"ports {busy} stayed in use: the server can't start"
        time.sleep(1)


# a server start and four jobs, each with its own local Ray, all on S3 (100 s alone; 191-251 s under
# two workers, here and on CI)
@pytest.mark.budget(360)
def test_the_object_storage_walk_through_keeps_everything_in_the_bucket(tmp_path):
    checkout = Checkout(tmp_path)
    shutil.rmtree(S3_DIR, ignore_errors=True)
    _wait_for_free([port + offset for port in (8333, 8888, 9333, 8080) for offset in (0, 10000)])
    try:
        result = checkout.run(DATA["object-storage"], env={"AWS_EC2_METADATA_DISABLED": "true"})
    finally:
        shutil.rmtree(S3_DIR, ignore_errors=True)
    assert result.returncode == 0, result.output[-4000:]
    assert re.search(r"^harmonic\s", result.output, re.M), result.output[-3000:]
    assert "s3://puma/runs/demo/" in result.output, result.output[-3000:]
    left = [str(Path(folder, name).relative_to(checkout.path))
            for folder, dirs, files in os.walk(checkout.path / "artifacts") for name in dirs + files]
    assert left in (["artifacts/weights"], []), f"the walk-through wrote outside the bucket: {left}"
