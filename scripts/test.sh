#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the linter and the whole test suite on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
