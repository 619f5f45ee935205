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

The budgets are also the schedule: modules run in the order of the largest budget they state,
largest first (the rest keep their order after them), so under ``pytest -n 2 --dist loadfile``
(scripts/test.sh) the long modules start first and no long one is left to run alone at the end.
"""

from __future__ import annotations

import os

import pytest

DEFAULT_BUDGET_S = 90.0
_SPENT = pytest.StashKey[dict]()


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
    if total > budget:
        spent["reported"] = True
        parts = " + ".join(f"{when} {spent[when]:.1f} s" for when in ("setup", "call", "teardown")
                           if when in spent)
        report.outcome = "failed"
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        report.longrepr = (f"{item.nodeid} took {total:.1f} s ({parts}), over its budget of {budget:g} s "
                           f"(load average {load} on {os.cpu_count()} CPUs; tests/budget.py): make it "
                           "faster, or state a larger budget with @pytest.mark.budget(seconds) and the "
                           "reason")
