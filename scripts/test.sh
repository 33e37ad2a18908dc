#!/usr/bin/env bash
# The project's test command (README "Run the tests"; CI calls this through .ci/run).
# Sets up .venv if needed, then lint + format check + the full pytest suite, slow tests
# included. Extra arguments go to pytest, e.g. `scripts/test.sh tests/dataloader -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
