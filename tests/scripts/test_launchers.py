"""scripts/train_local.sh, the submit helper's sbatch line, and a signal during a save.

The launchers are thin, so the tests run the real thing: `python -m train` on a shrunk
configs/debug.toml with the session's prepared Shakespeare data, under real torchrun.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest

from tests.utils.runs import LAUNCHER_SIZED, REPO, read_metrics, run_config, train_env, write_config

TRAIN_LOCAL = REPO / "scripts" / "train_local.sh"
SUBMIT = REPO / "scripts" / "slurm" / "submit.py"


def _count_gpus(**env: str) -> str:
    script = f"source {REPO}/scripts/slurm/launch_env.sh; count_visible_gpus"
    full_env = {k: v for k, v in train_env().items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run(["bash", "-c", script], env=full_env | env, capture_output=True, text=True)
    return out.stdout.strip()


def test_visible_gpus_follow_cuda_visible_devices():
    assert _count_gpus(CUDA_VISIBLE_DEVICES="0,1,3") == "3"
    assert _count_gpus(CUDA_VISIBLE_DEVICES="") == "0"
    assert _count_gpus(CUDA_VISIBLE_DEVICES="-1") == "0"


def test_train_local_rejects_bad_nproc_and_missing_config(tmp_path):
    bad = subprocess.run(
        [str(TRAIN_LOCAL), str(tmp_path / "missing.toml")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "missing.toml not found" in bad.stderr
    config = tmp_path / "x.toml"
    config.write_text("")
    bad = subprocess.run(
        [str(TRAIN_LOCAL), str(config)],
        env=train_env() | {"NPROC": "two"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "NPROC=two" in bad.stderr


@pytest.mark.slow
def test_train_local_trains_debug_config_on_two_cpu_processes(shakespeare_data, tmp_path):
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml", run_config(shakespeare_data, run_dir, LAUNCHER_SIZED)
    )
    env = {k: v for k, v in train_env().items() if k != "NPROC"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU-only machine, whatever this one is
    proc = subprocess.run(
        [str(TRAIN_LOCAL), str(config), "--training.steps", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "[train_local] 2 process(es), 0 GPU(s)" in log
    # two data-parallel ranks: global batch = 2 ranks x local batch 2 x accumulation
    shape = re.search(
        r"local batch size 2, global batch size (\d+), gradient accumulation steps (\d+)", log
    )
    assert shape, log[-4000:]
    assert int(shape[1]) == 2 * 2 * int(shape[2])
    # the override reached train
    assert [r["step"] for r in read_metrics(run_dir, "train")] == [1, 2, 3, 4]
    assert (run_dir / "checkpoint" / "step-4" / ".metadata").exists()

    # the exit status is the training's: a user error in train fails the launcher
    failed = subprocess.run(
        [str(TRAIN_LOCAL), str(config), "--training.no_such_key", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode != 0
    assert "no_such_key" in failed.stdout + failed.stderr


def test_submit_dry_print_fills_in_the_job_shape(shakespeare_data, tmp_path):
    config = write_config(
        tmp_path / "run.toml", run_config(shakespeare_data, tmp_path / "run", LAUNCHER_SIZED)
    )
    env = train_env() | {"TRAIN_NODES": "4", "SBATCH_ACCOUNT": "proj42"}
    out = subprocess.run(
        [
            sys.executable,
            str(SUBMIT),
            "--gpus-per-node",
            "8",
            "--partition",
            "gpu",
            "--time",
            "2:00:00",
            "--signal-seconds",
            "240",
            "--dry-print",
            str(config),
            "--training.steps",
            "7",
            "--fresh",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    for expected in (
        "sbatch",
        "--nodes=4",
        "--gres=gpu:8",
        "--partition=gpu",
        "--account=proj42",
        "--time=2:00:00",
        "--signal=B:USR1@240",
        f"TRAIN_RUN_DIR={tmp_path / 'run'}",
        "TRAIN_NPROC_PER_NODE=8",
        "train.sbatch",
        "--training.steps 7 --fresh",
    ):
        assert expected in line, (expected, line)

    # a config error is caught at submit time, as one line
    bad = subprocess.run(
        [sys.executable, str(SUBMIT), "--dry-print", str(config), "--training.stepz", "7"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "stepz" in bad.stderr


def _log_time(line: str) -> float:
    """Epoch seconds of a torchtitan log line ('[titan] 2026-01-01 12:00:00,123 - ...')."""
    stamp = line.split("]", 1)[1].strip()[:23]
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.slow
def test_signal_during_checkpoint_save_leaves_a_loadable_checkpoint(shakespeare_data, tmp_path):
    """SIGUSR1 lands inside a save: the save completes, the next step boundary saves
    again and exits 0 with preempted.json, and a resume loads it and continues."""
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml",
        run_config(shakespeare_data, run_dir, LAUNCHER_SIZED, training={"steps": 20}),
    )
    env = train_env() | {"NPROC": "1"}
    proc = subprocess.Popen(
        [str(TRAIN_LOCAL), str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, sent_at = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            # "Staging" with async checkpoints (the default), "Saving" with synchronous ones
            if sent_at is None and (
                "Staging the checkpoint" in line or "Saving the checkpoint" in line
            ):
                workers = subprocess.run(
                    ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
                ).stdout.split()
                assert len(workers) == 1, workers
                sent_at = time.time()
                os.kill(int(workers[0]), signal.SIGUSR1)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines)
    assert rc == 0, log[-4000:]
    assert sent_at is not None, "no checkpoint save seen in the log"
    finished = [
        _log_time(x) for x in lines if re.search(r"Finished (saving|staging) the checkpoint", x)
    ]
    assert finished and finished[0] > sent_at, (
        "the save finished before the signal was sent: the test did not hit a save in progress"
    )
    preempted = json.loads((run_dir / "preempted.json").read_text())
    assert preempted["signal"] == "SIGUSR1"
    step = preempted["step"]
    assert step < 20, "training ran to the end instead of stopping on the signal"
    for saved in (3, step):
        assert (run_dir / "checkpoint" / f"step-{saved}" / ".metadata").exists()

    resumed = subprocess.run(
        [str(TRAIN_LOCAL), str(config), "--training.steps", str(step + 2)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    steps = [r["step"] for r in read_metrics(run_dir, "train")]
    assert steps == list(range(1, step + 3)), steps
