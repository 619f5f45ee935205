#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the linter, build the user guide (mkdocs --strict) and run the whole
# test suite on this machine.
# The suite runs on PUMA_TEST_WORKERS pytest-xdist workers (default 2), one test module per worker at a
# time (--dist loadfile: a module's fixtures, e.g. its Ray cluster, are built once); the tests wait on
# Ray, S3 and process start-ups for part of their time: on 2 cores two workers finish 1.3x sooner than one.
# Extra arguments go to pytest (e.g. `-n 0` for one process, `-k name`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# our modules' byte-code, once: the suite starts hundreds of Python processes (Ray workers, jobs), and
# where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) each would compile them from source again
.venv/bin/python -m compileall -q -j 0 puma jobs tune tests >/dev/null
.venv/bin/ruff check .
# the user guide: a broken link, a page missing from the nav or a stale config reference fails here
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site" 2>&1 | { grep -v '│' || true; }
rm -rf "$site"
start=$(date +%s)
status=0
# --no-loadscope-reorder: modules go out in collection order, longest budget first (tests/budget.py);
# xdist's default order by number of tests sent the few-test, long modules (two-node, quick starts,
# sweep, killed runs) last, side by side, at loads of 20-33, with one worker alone at the end
.venv/bin/python -m pytest -n "${PUMA_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || status=$?
echo "tests: $(( $(date +%s) - start )) s on ${PUMA_TEST_WORKERS:-2} workers (exit status $status)"
exit "$status"
