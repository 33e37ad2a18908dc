#!/usr/bin/env bash
# Serve an exported model folder with vLLM's OpenAI-compatible server on 127.0.0.1.
# Usage: scripts/serve.sh HF_DIR [--port P] [--api-key K] [--timeout S]
# (thin wrapper over `python -m eval.serve`; see docs/eval.md)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
exec "$PY" -m eval.serve "$@"
