"""Time budgets per test (a pytest plugin, loaded by conftest.py): a slow test fails the day it lands.

Every test has a budget in seconds for its whole time: set-up (the module and session fixtures it
is the first to need included, as pytest reports them), call and teardown. The default is
``DEFAULT_BUDGET_S``; a test that needs more says so, with the reason beside it:

    @pytest.mark.budget(440)  # two Ray nodes, a node lost and replaced mid-epoch (149-218 s)
    def test_...

A stated budget is about twice the slowest time the test has taken under scripts/test.sh's two
workers: CI's machines are shared, and a test has been seen there at twice its usual time (the
console test, 219 s against 83-110 s); a change that doubles a test's time is still caught.

A test over its budget fails with its time and budget named, and the machine's load average, to tell
a crowded machine from a slower test (a passing test turns into a failure; an over-long teardown is
reported as a teardown error). ``PUMA_TEST_BUDGET_SCALE`` multiplies every
budget (e.g. 2 on a machine known to be twice as slow as CI's 2 cores; 0 turns the check off).

A crowded machine stretches the budget by itself: the load average is sampled every
``LOAD_SAMPLE_S`` while the test runs, and where its mean exceeds what the suite's two workers
make at most (``NORMAL_LOAD_PER_CPU`` runnable processes per CPU: 12 on 2 CPUs, where a whole run
averaged 8.2 and peaked at 16), the budget grows by the same ratio.
A test that is slower by itself is still caught at the usual load, where the budget does not move.

The budgets are also the schedule: modules run in the order of the largest budget they state,
largest first (the rest keep their order after them), so under ``pytest -n 2 --dist loadfile
--no-loadscope-reorder`` (scripts/test.sh) the long modules start first and no long one is left to
run alone at the end. Without ``--no-loadscope-reorder`` xdist orders modules by their number of tests
instead, which puts the long few-test modules last.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

DEFAULT_BUDGET_S = 90.0
NORMAL_LOAD_PER_CPU = 6.0  # runnable processes per CPU that scripts/test.sh's two workers make
LOAD_SAMPLE_S = 2.0
_SPENT = pytest.StashKey[dict]()
_STARTED = pytest.StashKey[float]()


class LoadSampler:
    """The 1-minute load average, sampled every LOAD_SAMPLE_S by a daemon thread (started on first use)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="budget-load", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                self.samples.append((time.monotonic(), os.getloadavg()[0]))
                del self.samples[:-2000]  # about an hour at 2 s
            time.sleep(LOAD_SAMPLE_S)

    def mean_since(self, start: float) -> float:
        """The mean of the samples taken since ``start`` (monotonic), with the load now."""
        with self._lock:
            values = [load for at, load in self.samples if at >= start]
        values.append(os.getloadavg()[0])
        return sum(values) / len(values)


LOAD = LoadSampler()


def crowding(mean_load: float) -> float:
    """How much a machine at ``mean_load`` stretches a budget: 1 up to the suite's usual load, then the
    ratio of the load to it."""
    return max(1.0, mean_load / (NORMAL_LOAD_PER_CPU * (os.cpu_count() or 1)))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "budget(seconds): this test's time budget (set-up + call + "
                                       f"teardown), default {DEFAULT_BUDGET_S:g} s; see tests/budget.py")


def stated_budget_s(item: pytest.Item) -> float | None:
    """The budget its marker states, None without one."""
    marker = item.get_closest_marker("budget")
    return float(marker.args[0]) if marker else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules in the order of the largest budget their tests state, largest first (stable: ties and
    the modules without one keep their order); the tests of a module stay together and in order."""
    stated: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        stated[path] = max(stated.get(path, 0.0), stated_budget_s(item) or 0.0)
    items.sort(key=lambda item: -stated[item.nodeid.split("::", 1)[0]])


def budget_s(item: pytest.Item) -> float:
    """The test's budget in seconds (its marker or the default), times PUMA_TEST_BUDGET_SCALE."""
    stated = stated_budget_s(item)
    seconds = DEFAULT_BUDGET_S if stated is None else stated
    return seconds * float(os.environ.get("PUMA_TEST_BUDGET_SCALE", "1"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    LOAD.start()
    item.stash.setdefault(_STARTED, time.monotonic())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    spent = item.stash.setdefault(_SPENT, {"reported": False})
    spent[report.when] = report.duration
    budget = budget_s(item)
    if not report.passed:
        spent["reported"] = True  # a failure of its own, reported as it is
    if budget <= 0 or report.when == "setup" or spent["reported"]:
        return
    total = sum(v for k, v in spent.items() if k != "reported")
    if total <= budget:
        return
    mean_load = LOAD.mean_since(item.stash.get(_STARTED, time.monotonic() - total))
    stretched = budget * crowding(mean_load)
    if total > stretched:
        spent["reported"] = True
        parts = " + ".join(f"{when} {spent[when]:.1f} s" for when in ("setup", "call", "teardown")
                           if when in spent)
        report.outcome = "failed"
        crowded = f", stretched to {stretched:.3g} s by the crowding" if stretched > budget else ""
        report.longrepr = (f"{item.nodeid} took {total:.1f} s ({parts}), over its budget of {budget:g} s "
                           f"(mean load {mean_load:.1f} on {os.cpu_count()} CPUs{crowded}; tests/budget.py): "
                           "make it faster, or state a larger budget with @pytest.mark.budget(seconds) "
                           "and the reason")
