"""Named fault points for crash tests: ``fault_point(name)`` ends the process at that moment.

A crash test runs a job with ``PUMA_FAULT_AT=<name>`` (optionally ``<name>:<n>``, the n-th time the
point is reached, 1-based) in its environment; when the point is reached the process exits at once
with status 137 (as if killed by SIGKILL: no ``finally``, no flushing), so the test sees exactly the
state a kill at that moment leaves. Without the variable a fault point costs one dict lookup.

Points: ``index.shard_written`` (a shard's Parquet written, its index not yet), ``index.commit``
(every file of a commit written, the manifest not yet), ``versions.promote`` (the new version
verified, the alias not yet switched), ``versions.retain`` (an old version's manifest deleted, its
files not yet), ``embed.block`` (a block of embeddings committed, the next not yet).

``PUMA_FAULT_DELAY=<name>:<seconds>`` makes ``await fault_delay(name)`` wait that long instead (a
slow request for overload tests; point ``serve.search``: a search request, before it is answered).

``PUMA_FAULT_HOLD=<name>:<path>`` makes ``fault_hold(name)`` wait while the file ``path`` exists (at most
``HOLD_LIMIT_S``): a kill test holds the process at that moment, kills it there, and removes the file
to let the moments it does not kill at pass. Point ``train.checkpoint``: rank 0 of a training run, its
epoch's checkpoint complete on storage, best/ not yet published, the next epoch not yet started. The
jobs hand every ``PUMA_FAULT_*`` variable of the driver to their Ray workers (puma/runtime.py).
"""

from __future__ import annotations

import asyncio
import os
import time

ENV = "PUMA_FAULT_AT"
DELAY_ENV = "PUMA_FAULT_DELAY"
HOLD_ENV = "PUMA_FAULT_HOLD"
HOLD_LIMIT_S = 600.0
_seen: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Exit the process now (status 137) if ``PUMA_FAULT_AT`` names this point (and this visit)."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition(":")
    if point != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] >= int(nth or 1):
        os._exit(137)


async def fault_delay(name: str) -> None:
    """Wait the seconds ``PUMA_FAULT_DELAY`` gives this point (if it names it)."""
    wanted = os.environ.get(DELAY_ENV)
    if not wanted:
        return
    point, _, seconds = wanted.partition(":")
    if point == name:
        await asyncio.sleep(float(seconds or 0))


def fault_hold(name: str) -> None:
    """Wait while the file ``PUMA_FAULT_HOLD`` gives this point exists (if it names it)."""
    wanted = os.environ.get(HOLD_ENV)
    if not wanted:
        return
    point, _, path = wanted.partition(":")
    deadline = time.monotonic() + HOLD_LIMIT_S
    while point == name and os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
