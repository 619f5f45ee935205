"""The console: progress shown in place on a terminal, as plain periodic lines in logs, and as events
from Ray workers that the driver shows; and a real training run whose console holds our lines once
and none of Ray's own (unless --verbose)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import yaml
from tiny import TINY_BACKBONE

from puma import console
from puma.data.prepare import prepare
from puma.data.sources import SourceSpec

REPO = Path(__file__).resolve().parent.parent
FLOWERS = REPO.parent / "shared" / "data" / "flowers12-subset"


class Clock:
    """A settable clock for the console (``console._now``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal:
    """A stream that says it is a terminal and renders carriage returns and line clears like one."""

    def __init__(self) -> None:
        self.raw = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> None:
        self.raw += text

    def flush(self) -> None:
        pass

    def screen(self) -> list[str]:
        """What stays visible: each line as its last redraw left it."""
        return [line.split("\r")[-1].replace("\x1b[K", "") for line in self.raw.split("\n")]


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(console, "_now", fake)
    monkeypatch.delenv(console.CONSOLE_ENV, raising=False)
    yield fake
    console.show_remote()


def test_plain_lines_come_periodically_with_rate_and_eta(clock, capsys):
    bar = console.Progress("epoch 1/3", 100, "steps", "img", mode="plain", every_s=30)
    clock.now += 10
    bar.update(10, items=640, note="loss 2.5000")
    assert capsys.readouterr().out == ""  # not due yet
    clock.now += 21
    bar.update(10, items=640, note="loss 2.2500")
    # 1,280 images in 31 s = 41.3 img/s; 80 steps left at 31 s per 20 steps = 124 s
    expected = "[puma] epoch 1/3: 20/100 steps (20%), 41.3 img/s, ETA 2m04s, loss 2.2500\n"
    assert capsys.readouterr().out == expected
    clock.now += 31
    bar.update(80, items=5120, note="loss 1.0000")
    bar.close()
    bar.close()  # once only
    out = capsys.readouterr().out.splitlines()
    assert out == ["[puma] epoch 1/3: 100/100 steps (100%), 103.2 img/s, ETA 0s, loss 1.0000",
                   "[puma] epoch 1/3: 100/100 steps, 103.2 img/s, in 1m02s, loss 1.0000"]


def test_slow_units_show_time_per_unit_and_unknown_totals_no_eta(clock, capsys):
    bar = console.Progress("trials", None, "trials", mode="plain", every_s=1e9)
    clock.now += 300
    bar.update(2)
    bar.close()
    assert capsys.readouterr().out == "[puma] trials: 2 trials, 2m30s/trial, in 5m00s\n"
    assert [console.format_duration(s) for s in (0.4, 59, 61, 3725)] == ["0s", "59s", "1m01s", "1h02m"]


def test_terminal_bar_redraws_in_place_and_lines_print_above_it(clock, monkeypatch):
    term = Terminal()
    monkeypatch.setattr(console, "_stream", lambda: term)
    bar = console.Progress("evaluation", 4, "img", mode="tty")
    for _ in range(3):
        clock.now += 1
        bar.update()
    assert term.screen() == ["[puma] evaluation  |##################------|  3/4 img  1.0 img/s  ETA 1s"]
    console.say("a line of ours")
    assert term.screen()[-2:] == ["[puma] a line of ours", term.screen()[-1]]
    assert term.screen()[-1].startswith("[puma] evaluation  |")  # drawn again under the line
    clock.now += 1
    bar.update()
    bar.close()
    assert [line for line in term.screen() if line] == ["[puma] a line of ours",
                                                      "[puma] evaluation: 4/4 img, 1.0 img/s, in 4s"]
    assert console._active is None


def test_worker_events_become_the_drivers_display_and_only_our_lines_are_taken(clock, capsys, monkeypatch):
    monkeypatch.setenv(console.CONSOLE_ENV, "events")  # a Ray worker of a puma job
    bar = console.progress("epoch 1/2", 3, "steps", "img")
    for step in range(3):
        clock.now += 0.6  # events at most once a second
        bar.update(1, items=8, note=f"loss {3 - step:.4f}")
    bar.close()
    events = capsys.readouterr().out.splitlines()
    assert len(events) == 2 and all(e.startswith(console.EVENT) for e in events)
    assert json.loads(events[-1][len(console.EVENT):])["closed"] is True

    monkeypatch.delenv(console.CONSOLE_ENV)  # now the driver, writing to a log (not a terminal)
    assert all(console.take_remote_line(e) for e in events)
    assert capsys.readouterr().out == "[puma] epoch 1/2: 3/3 steps, 13.3 img/s, in 2s, loss 1.0000\n"
    assert console.take_remote_line("[puma] before training: harmonic/r@1=0.5")
    assert not console.take_remote_line("Progress bars disabled. To enable, set ...")
    assert not console.take_remote_line(f"{console.EVENT}not json")
    assert capsys.readouterr().out == "[puma] before training: harmonic/r@1=0.5\n"
    console.show_remote(progress=False, tags=("[puma.sweep]",))  # a sweep: trials, not their epochs
    assert console.take_remote_line("[puma] epoch 1: loss 2.0") and console.take_remote_line(events[0])
    assert console.take_remote_line("[puma.sweep] trial abc starts")
    assert capsys.readouterr().out == "[puma.sweep] trial abc starts\n"


# ----------------------------------------------------------------------------- a real job's console


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A tiny PUMA config on 6 Oxford-Flowers species x 8 real photos (3 train / 3 test classes)."""
    root = tmp_path_factory.mktemp("console")
    photos = root / "flowers"
    for species in sorted(p for p in FLOWERS.iterdir() if p.is_dir())[:6]:
        (photos / species.name).mkdir(parents=True)
        for photo in sorted(species.glob("*.jpg"))[:8]:
            shutil.copy(photo, photos / species.name / photo.name)
    prepare([SourceSpec("folder", "flowers", str(photos))], str(root / "prepared"), log=lambda _: None)
    cfg = {"model": {"backbone": dict(TINY_BACKBONE), "adapter": {"rank": 8},
                     "prompt_pool": {"pool_size": 4, "length": 2}, "head": {"embed_dim": 16}},
           "data": {"uri": str(root / "prepared"), "preset": "", "decode_batch_size": 8},
           "train": {"epochs": 2, "batch_size": 8, "cpus_per_worker": 0.5, "storage_path": str(root / "runs"),
                     "run_name": "console", "max_failures": 0},
           "eval": {"batch_size": 8}}
    (root / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    return root


def _train(root: Path, *args: str) -> tuple[int, list[str]]:
    """jobs/train.py as a user runs it: its own local Ray (the embedded default's path); all lines."""
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths stay < 108 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", console.CONSOLE_ENV)}
    env.update(PUMA_RAY_TMP=ray_tmp, PUMA_PROGRESS_EVERY_S="0.5")  # periodic plain lines, even here
    try:
        done = subprocess.run([sys.executable, "jobs/train.py", "--config", str(root / "tiny.yaml"), *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return done.returncode, (done.stdout + done.stderr).splitlines()


RAY_NOISE = re.compile(r"\b(INFO|WARNING|WARN|ERROR|DEBUG)\b|pid=|\(raylet\)|Ray deduplicates|Progress bars|"
                       r"Deprecat|Warning:|Traceback|faiss|Execution plan|Dataset |Checkpoint successfully")


# two jobs/train.py runs with their own local Ray: 58-69 s alone, 83-110 s beside another, 219 s once on CI
@pytest.mark.budget(240)
def test_training_console_holds_our_lines_once_and_no_ray_noise(tiny_run):
    rc, lines = _train(tiny_run)
    text = "\n".join(lines)
    assert rc == 0, text[-4000:]
    repeated = {line: n for line, n in Counter(lines).items() if n > 1}
    assert not repeated, f"lines printed more than once: {repeated}"
    noise = [line for line in lines if RAY_NOISE.search(line)]
    assert not noise, f"Ray's own output on the console: {noise[:10]}"
    table = [line for line in lines if not line.startswith("[puma")]
    assert [row.split()[0] for row in table] == ["dataset", "flowers", "unified", "harmonic"], text
    # a progress display per stage, ending in its final line; periodic lines before it (PUMA_PROGRESS_EVERY_S)
    for stage in ("evaluation (frozen backbone)", "epoch 1/2", "epoch 2/2", "evaluation after epoch 2"):
        finals = [line for line in lines if line.startswith(f"[puma] {stage}: ") and " in " in line]
        assert len(finals) == 1, (stage, text)
    final_epoch = r"^\[puma\] epoch 1/2: 3/3 steps, [\d.]+ img/s, in (\d+m)?\d+s, loss \d+\.\d{4}$"
    assert re.search(final_epoch, text, re.M), text
    final_eval = r"^\[puma\] evaluation after epoch 2: 24/24 img, [\d.]+ img/s, in (\d+m)?\d+s$"
    assert re.search(final_eval, text, re.M), text
    assert sum(line.startswith("[puma] before training (frozen backbone): ") for line in lines) == 1
    assert re.match(r"\[puma\] Ray: local Ray \(\d+ logical CPUs\); Ray's own logs: /tmp/ray", lines[0]), text

    rc, verbose = _train(tiny_run, "--verbose")  # resumes the finished run: Ray's output is back
    text = "\n".join(verbose)
    assert rc == 0, text[-4000:]
    assert any("pid=" in line for line in verbose), "--verbose shows the workers' own output"
    assert any("Started a local Ray instance" in line for line in verbose), "and Ray's driver logs"
    ours = [line for line in verbose if line.startswith("[puma") and "Ray:" not in line]
    assert ours and not [line for line, n in Counter(ours).items() if n > 1], ours
    assert sum(line.startswith("[puma] resumed from ") for line in verbose) == 1, text[-4000:]
