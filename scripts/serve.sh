#!/usr/bin/env bash
# Serve an exported model folder with vLLM's OpenAI-compatible server on 127.0.0.1.
# Usage: scripts/serve.sh HF_DIR [--port P] [--api-key K] [--timeout S] [--log FILE]
#        [--tensor-parallel-size N] [--pipeline-parallel-size N] [--quantization fp8]
#        [--kv-cache-dtype auto|fp8]
#        [--max-num-seqs N] [--gpu-memory-utilization F] [--max-model-len N]
# (thin wrapper over `python -m eval.serve`; see docs/eval.md)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
exec "$PY" -m eval.serve "$@"
