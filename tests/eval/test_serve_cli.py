"""`scripts/serve.sh HF` as the README shows it: serves, answers, and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from dataloader.common import free_port

REPO = Path(__file__).resolve().parents[2]


def _vllm_processes_for(model_dir: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "vllm.entrypoints" in cmdline and str(model_dir) in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_serve_sh_serves_on_loopback_and_stops_cleanly_on_sigterm(trained, tmp_path):
    _, hf = trained
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [str(REPO / "scripts" / "serve.sh"), str(hf), "--port", str(port), "--log", str(log)]
    cmd += ["--max-model-len", "512"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once /health and /v1/models answer
        assert f"on http://127.0.0.1:{port}" in line, line + proc.stderr.read()[-3000:]
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert models["data"][0]["id"]
        assert _vllm_processes_for(hf), "no vLLM process found while serving"

        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    # the server behind the wrapper is gone too, and the port is free again
    deadline = time.monotonic() + 30
    while _vllm_processes_for(hf) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _vllm_processes_for(hf), "vLLM outlived its wrapper"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
