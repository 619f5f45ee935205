"""The console: progress shown in place on a terminal, as plain periodic lines in logs, and as events
from Ray workers that the driver shows. A real training run's console (our lines once, none of Ray's own
unless --verbose) is tested on the README's own command, in tests/test_quickstarts.py."""

from __future__ import annotations

import json

import pytest

from puma import console


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
