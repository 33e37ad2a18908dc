"""Fast failure paths of the eval CLIs: one-line errors, exit code 2, file:line for tasks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dataloader.common import free_port
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


def test_attention_backend_read_from_vllm_log_lines():
    from eval.serve import attention_backend_from_log

    # The two lines vllm/platforms/cuda.py logs for a requested and a self-chosen backend.
    requested = "(EngineCore pid=1) INFO 11-21 13:12:53 [cuda.py:446] Using TRITON_ATTN backend."
    chosen = (
        "INFO [cuda.py:507] Using FLASH_ATTN attention backend out of potential backends: "
        "['FLASH_ATTN', 'TRITON_ATTN']."
    )
    vit = "INFO Using Torch SDPA backend for ViT model."
    assert attention_backend_from_log(f"x\n{requested}\ny") == "TRITON_ATTN"
    assert attention_backend_from_log(chosen) == "FLASH_ATTN"
    assert (
        attention_backend_from_log(f"{vit}\nTriton is installed, but doesn't include CPU backend.")
        is None
    )


@pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("lm_eval") is not None,
    reason="lm_eval is installed",
)
def test_lm_eval_bridge_without_lm_eval_is_clear(tmp_path):
    proc = _run("eval", "--server", "http://127.0.0.1:9", "--lm-eval", "arc_easy")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: --lm-eval needs lm-evaluation-harness")
