"""The console of every job: our lines once, and a progress display for each long stage (no Ray here).

``say(msg)`` prints ``[puma] msg``. ``progress(label, total, unit)`` returns a :class:`Progress` that
a stage advances with ``update()`` and ends with ``close()`` (or a ``with`` block). How it shows
depends on where it runs:

- on a terminal: one status line redrawn in place (bar, count, rate, ETA), at most 10 times a second;
- elsewhere (a log file, CI, a pipe): a plain line every ``PUMA_PROGRESS_EVERY_S`` seconds (default
  30) and one when the stage ends, so logs show progress without a wall of carriage returns;
- in a Ray worker of a puma job (``PUMA_CONSOLE=events``, set by :mod:`puma.runtime`): progress goes
  out as ``[puma:progress] {json}`` event lines, at most one a second, which the driver turns back
  into the display above (:func:`take_remote_line`), so a bar of a Train worker shows on the driver.

Lines are written with ``sys.stdout.write``, not ``print``: Ray Train patches ``print`` in its
workers to tee every call to stdout *and* to a logger that writes to stderr, which is why each
worker line used to reach the driver twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import TextIO

TAG = "[puma]"
EVENT = "[puma:progress] "  # worker -> driver progress events (one JSON object per line)
CONSOLE_ENV = "PUMA_CONSOLE"  # "events" in Ray workers started by a puma driver
EVERY_ENV = "PUMA_PROGRESS_EVERY_S"
TTY_REDRAW_S = 0.1
EVENT_EVERY_S = 1.0
BAR_WIDTH = 24
_lock = threading.RLock()
_active: Progress | None = None  # the status line drawn in place on a terminal
_mirrors: dict[str, Progress] = {}  # driver copies of worker progress, by event id
_remote_progress = True  # whether the driver shows worker progress events (a sweep shows trials instead)
_remote_tags: tuple[str, ...] = ("[puma",)  # which of our forwarded worker lines the driver shows
_verbose = False  # the job's --verbose: Ray's own output and tracebacks of user errors reach the console


def _now() -> float:
    return time.monotonic()


def _stream() -> TextIO:
    return sys.stdout


def _is_tty(stream: TextIO) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def set_verbose(verbose: bool) -> None:
    """Set by the job's command line (``--verbose``)."""
    global _verbose
    _verbose = bool(verbose)


def is_verbose() -> bool:
    """Whether the job runs with ``--verbose``."""
    return _verbose


def emits_events() -> bool:
    """True in a Ray worker of a puma job: progress leaves as event lines for the driver."""
    return os.environ.get(CONSOLE_ENV) == "events"


@contextlib.contextmanager
def outside_bar() -> Iterator[None]:
    """Clear the status line while someone else writes to the terminal, and draw it again after."""
    with _lock:
        drawn = _active if _active is not None and _is_tty(_stream()) else None
        if drawn is not None:
            _stream().write("\r\x1b[K")
            _stream().flush()
        try:
            yield
        finally:
            if drawn is not None and _active is drawn:
                drawn.draw()


def write_line(line: str) -> None:
    """One finished line on stdout (a status line being drawn on a terminal is cleared and redrawn)."""
    with _lock:
        stream = _stream()
        bar = _active if _active is not None and _is_tty(stream) else None
        if bar is not None:
            stream.write("\r\x1b[K")
        stream.write(line.rstrip("\n") + "\n")
        if bar is not None:
            bar.draw()
        stream.flush()


def say(msg: str, tag: str = TAG) -> None:
    """Print ``[puma] msg`` once (also from Ray Train workers, whose ``print`` reaches the driver twice)."""
    write_line(f"{tag} {msg}")


def show_remote(progress: bool = True, tags: tuple[str, ...] = ("[puma",)) -> None:
    """What of its workers' output the driver shows: their progress, and our lines starting with one
    of ``tags`` (a sweep shows its trials, not every trial's epochs)."""
    global _remote_progress, _remote_tags
    _remote_progress, _remote_tags = progress, tags


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """One long stage: a count towards ``total`` (None: unknown), a rate and an ETA."""

    def __init__(self, label: str, total: int | None, unit: str = "", item_unit: str = "",
                 tag: str = TAG, mode: str = "", every_s: float | None = None, key: str = "") -> None:
        self.label, self.total, self.unit, self.item_unit, self.tag = label, total, unit, item_unit, tag
        self.key = key or uuid.uuid4().hex[:12]
        self.mode = mode or ("events" if emits_events() else "tty" if _is_tty(_stream()) else "plain")
        self.every_s = every_s if every_s is not None else float(os.environ.get(EVERY_ENV, "30"))
        self.done, self.items, self.closed, self.note = 0, 0, False, ""
        self._start = _now()
        self._elapsed: float | None = None  # set by events from a worker (its own clock)
        self._last_out = self._start
        self._last_line = ""  # the last plain line: a line that would repeat it is left out

    @property
    def elapsed(self) -> float:
        """Seconds since the stage started."""
        return self._elapsed if self._elapsed is not None else _now() - self._start

    def update(self, n: int = 1, items: int = 0, note: str = "") -> None:
        """Advance by ``n`` units (and ``items``, e.g. images in ``n`` steps); ``note`` (e.g. the loss)
        replaces the last one; show if due."""
        self.done += n
        self.items += items
        self.note = note or self.note
        self._show()

    def close(self) -> None:
        """End the stage: the final line (count, time, rate)."""
        if self.closed:
            return
        self.closed = True
        self._show(final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _show(self, final: bool = False) -> None:
        now = _now()
        if self.mode == "off":
            return
        if self.mode == "events":
            if final or now - self._last_out >= EVENT_EVERY_S:
                self._last_out = now
                _stream().write(EVENT + json.dumps(self.state(), separators=(",", ":")) + "\n")
                _stream().flush()
        elif self.mode == "tty":
            self._show_tty(final, now)
        elif final or now - self._last_out >= self.every_s:
            self._last_out = now
            line = self.plain_line(final)
            if line != self._last_line:
                self._last_line = line
                write_line(line)

    def _show_tty(self, final: bool, now: float) -> None:
        global _active
        with _lock:
            if final:
                if _active is self:
                    _active = None
                    _stream().write("\r\x1b[K")
                write_line(self.plain_line(final=True))
                return
            first, _active = _active is not self, self
            if first or now - self._last_out >= TTY_REDRAW_S:
                self._last_out = now
                self.draw()

    def draw(self) -> None:
        """Redraw the status line in place (terminal mode)."""
        width = shutil.get_terminal_size((100, 20)).columns
        _stream().write("\r\x1b[K" + self.status_line()[: max(20, width - 1)])
        _stream().flush()

    def rate(self) -> float | None:
        """Items (or units) per second so far; None before anything happened."""
        count = self.items if self.item_unit else self.done
        return count / self.elapsed if count and self.elapsed > 0 else None

    def eta(self) -> float | None:
        """Seconds left at the rate so far; None when the total or the rate is unknown."""
        if not self.total or not self.done or self.elapsed <= 0:
            return None
        return max(0.0, (self.total - self.done) * self.elapsed / self.done)

    def _count(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"{self.done}/{self.total}{unit}" if self.total else f"{self.done}{unit}"

    def _rate(self) -> str:
        """``52.1 img/s``; slow units as time per unit (``2m10s/trial``)."""
        rate, unit = self.rate(), self.item_unit or self.unit or "it"
        if rate is None:
            return ""
        return f"{rate:.1f} {unit}/s" if rate >= 0.1 else f"{format_duration(1 / rate)}/{unit.rstrip('s')}"

    def status_line(self) -> str:
        """``[puma] label |#####-----| 120/376 steps  52.1 img/s  ETA 2m05s`` (terminal)."""
        parts = [f"{self.tag} {self.label}"]
        if self.total:
            filled = int(BAR_WIDTH * min(self.done, self.total) / self.total)
            parts.append("|" + "#" * filled + "-" * (BAR_WIDTH - filled) + "|")
        parts += [self._count(), self._rate()]
        eta = self.eta()
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        return "  ".join(p for p in [*parts, self.note] if p)

    def plain_line(self, final: bool = False) -> str:
        """``[puma] label: 120/376 steps (32%), 52.1 img/s, ETA 2m05s`` (logs); the last says the time."""
        text = f"{self.tag} {self.label}: {self._count()}"
        if self.total and not final:
            text += f" ({100 * self.done // self.total}%)"
        extras = [self._rate()]
        eta = self.eta()
        if final:
            extras.append(f"in {format_duration(self.elapsed)}")
        elif eta is not None:
            extras.append(f"ETA {format_duration(eta)}")
        extras = [e for e in [*extras, self.note] if e]
        return text + (", " + ", ".join(extras) if extras else "")

    def state(self) -> dict:
        """The event a worker sends to the driver."""
        return {"key": self.key, "label": self.label, "total": self.total, "unit": self.unit,
                "item_unit": self.item_unit, "tag": self.tag, "done": self.done, "items": self.items,
                "note": self.note, "elapsed": round(self.elapsed, 3), "closed": self.closed}


def progress(label: str, total: int | None, unit: str = "", item_unit: str = "", tag: str = TAG,
             key: str = "", show: bool = True) -> Progress:
    """A progress display for one long stage (see the module docstring for where it shows);
    ``show=False`` counts without showing (e.g. on every Train worker but rank 0)."""
    return Progress(label, total, unit, item_unit, tag=tag, key=key, mode="" if show else "off")


def take_remote_line(line: str) -> bool:
    """Driver side: show a line forwarded from a Ray worker if it is ours; False for anyone else's.

    Our lines (``[puma...]``) are printed once, without Ray's ``(Actor pid=...)`` prefix; progress
    events update the same display a local stage would have (both as :func:`show_remote` allows).
    """
    if line.startswith(EVENT):
        try:
            state = json.loads(line[len(EVENT):])
        except ValueError:
            return False
        if _remote_progress:
            _mirror(state)
        return True
    if line.startswith("[puma"):
        if line.startswith(_remote_tags):
            write_line(line)
        return True
    return False


def _mirror(state: dict) -> None:
    """Update (or start) the driver's copy of a worker's progress from one of its events."""
    key = str(state.get("key", ""))
    with _lock:
        bar = _mirrors.get(key)
        if bar is None:
            bar = _mirrors[key] = Progress(str(state.get("label", "")), state.get("total"),
                                           str(state.get("unit", "")), str(state.get("item_unit", "")),
                                           tag=str(state.get("tag", TAG)), key=key,
                                           mode="tty" if _is_tty(_stream()) else "plain")
        bar.done, bar.items = int(state.get("done", 0)), int(state.get("items", 0))
        bar.note = str(state.get("note", ""))
        bar._elapsed = float(state.get("elapsed", 0.0))
        if state.get("closed"):
            _mirrors.pop(key, None)
            bar.close()
        else:
            bar._show()
