#!/usr/bin/env bash
# The whole pipeline on the embedded Shakespeare corpus, on this machine:
#   prepare -> train (FP8, FSDP, 2 procs) -> kill -> resume on 1 proc -> export -> vLLM -> eval
# On a fresh machine it first creates .venv (scripts/setup.sh). Options go to
# scripts/quickstart.py (`scripts/quickstart.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python scripts/quickstart.py "$@"
