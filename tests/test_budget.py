"""The per-test time budget (tests/budget.py): a test over its budget fails, naming its time and budget."""

from __future__ import annotations

import os

import budget
import pytest

PROBE = """
import time
import pytest

def test_fast():
    pass

@pytest.mark.budget(0.2)
def test_slow_call():
    time.sleep(0.4)

@pytest.fixture
def slow_teardown():
    yield
    time.sleep(0.4)

@pytest.mark.budget(0.2)
def test_slow_teardown(slow_teardown):
    pass

@pytest.mark.budget(0.2)
def test_failing_on_its_own():
    time.sleep(0.4)
    assert False, "its own failure"
"""


def _load(monkeypatch, per_cpu: float) -> None:
    """The machine's load while the probe runs, as the budget sees it."""
    monkeypatch.setattr(budget.LOAD, "mean_since", lambda start: per_cpu * (os.cpu_count() or 1))


def test_a_test_over_its_budget_fails_and_says_by_how_much(pytester: pytest.Pytester, monkeypatch):
    monkeypatch.setenv("PUMA_TEST_BUDGET_SCALE", "1")  # as CI runs it, whatever this run was given
    _load(monkeypatch, 1.0)  # a quiet machine, whatever this one is doing now
    pytester.makeconftest("pytest_plugins = ['budget']")
    pytester.makepyfile(test_probe=PROBE)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2, errors=1)  # the slow teardown: passed, then a teardown error
    for line in ("*test_slow_call took * s (setup * s + call * s), over its budget of 0.2 s (mean load *",
                 "*test_slow_teardown took * s (setup * s + call * s + teardown * s), over its budget*",
                 "*its own failure*"):  # a test failing by itself keeps its own report, and only it
        result.stdout.fnmatch_lines([line])
    assert "test_failing_on_its_own took" not in result.stdout.str()


def test_a_crowded_machine_stretches_the_budget_by_its_load_over_the_usual(pytester: pytest.Pytester,
                                                                           monkeypatch):
    monkeypatch.setenv("PUMA_TEST_BUDGET_SCALE", "1")
    pytester.makeconftest("pytest_plugins = ['budget']")
    pytester.makepyfile(test_probe=PROBE)
    _load(monkeypatch, budget.NORMAL_LOAD_PER_CPU * 3)  # three times the suite's usual: 0.2 s -> 0.6 s
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=3, failed=1)
    _load(monkeypatch, budget.NORMAL_LOAD_PER_CPU * 1.5)  # 0.2 s -> 0.3 s: the 0.4 s tests still fail
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_slow_call took * s*, over its budget of 0.2 s (mean load *, "
                                 "stretched to 0.3 s by the crowding; tests/budget.py)*"])
    _load(monkeypatch, budget.NORMAL_LOAD_PER_CPU)  # the usual load stretches nothing
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2, failed=2, errors=1)


def test_the_scale_stretches_every_budget(pytester: pytest.Pytester, monkeypatch):
    monkeypatch.setenv("PUMA_TEST_BUDGET_SCALE", "10")
    _load(monkeypatch, 1.0)
    pytester.makeconftest("pytest_plugins = ['budget']")
    pytester.makepyfile(test_probe=PROBE)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=3, failed=1)


def test_modules_that_state_larger_budgets_run_first(pytester: pytest.Pytester):
    pytester.makeconftest("pytest_plugins = ['budget']")
    pytester.makepyfile(test_a="def test_a1(): pass\ndef test_a2(): pass\n",
                        test_b="import pytest\n\n@pytest.mark.budget(5)\ndef test_b1(): pass\n",
                        test_c="import pytest\n\ndef test_c1(): pass\n\n"
                               "@pytest.mark.budget(9)\ndef test_c2(): pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--collect-only", "-q")
    ids = [line for line in result.stdout.lines if "::" in line]
    assert ids == ["test_c.py::test_c1", "test_c.py::test_c2", "test_b.py::test_b1", "test_a.py::test_a1",
                   "test_a.py::test_a2"], ids
