"""scripts/train_local.sh, the submit helper's sbatch line, and a signal during a save.

The launchers are thin, so the tests run the real thing: `python -m train` on a shrunk
configs/debug.toml with the session's prepared Shakespeare data, under real torchrun.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from common import run_layout
from common.run_lease import RunLease
from tests.utils.runs import (
    LAUNCHER_SIZED,
    REPO,
    children_of,
    cli,
    complete_steps,
    live_pids,
    proc_stat,
    read_metrics,
    run_config,
    train_env,
    write_config,
)

TRAIN_LOCAL = REPO / "scripts" / "train_local.sh"
SUBMIT = REPO / "scripts" / "slurm" / "submit.py"


def fake_nvidia_smi(folder, *gpus: str) -> str:
    """A PATH whose `nvidia-smi -L` lists `gpus` (the driver's view, stubbed)."""
    folder.mkdir(exist_ok=True)
    listing = "".join(f"echo 'GPU {i}: {name} (UUID: GPU-{i})'\n" for i, name in enumerate(gpus))
    (folder / "nvidia-smi").write_text(f"#!/bin/sh\n{listing}")
    (folder / "nvidia-smi").chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


def test_launchers_count_the_gpus_the_driver_lists_that_cuda_visible_devices_keeps(tmp_path):
    """The launcher's process count and the worker's GPU check use one rule
    (common/launch_env.py `visible_gpus`)."""
    path = fake_nvidia_smi(tmp_path / "bin", *["NVIDIA H100"] * 4)
    script = f"source {REPO}/scripts/slurm/launch_env.sh; count_visible_gpus"
    env = {k: v for k, v in train_env().items() if k != "CUDA_VISIBLE_DEVICES"} | {"PATH": path}
    counts = {}
    for visible in (None, "0,1,3", "", "-1"):
        full_env = env if visible is None else env | {"CUDA_VISIBLE_DEVICES": visible}
        out = subprocess.run(["bash", "-c", script], env=full_env, capture_output=True, text=True)
        counts[visible] = out.stdout.strip()
    assert counts == {None: "4", "0,1,3": "3", "": "0", "-1": "0"}


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
    # a rank per GPU: more processes than visible GPUs is one line before any worker starts
    # (torchtitan would give ranks 2 and 3 a cuda device that does not exist)
    path = fake_nvidia_smi(tmp_path / "bin", "NVIDIA H100", "NVIDIA H100")
    env = {k: v for k, v in train_env().items() if k != "CUDA_VISIBLE_DEVICES"} | {"PATH": path}
    for args in ([str(config)], ["--replica-groups", "2", str(config)]):
        bad = subprocess.run(
            [str(TRAIN_LOCAL), *args], env=env | {"NPROC": "3"}, capture_output=True, text=True
        )
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert "NPROC=3 is more than the 2 visible GPU(s)" in bad.stderr, bad.stderr


def _processes_with(marker: str) -> list[int]:
    """The live processes whose environment holds LAUNCH_TEST_MARK=marker (everything a
    launch started: agent, workers, checkpoint daemons), found through /proc."""
    found = []
    for pid in live_pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        fields = proc_stat(pid)  # None: ended since; "Z": a zombie
        marked = f"LAUNCH_TEST_MARK={marker}".encode() in environ.split(b"\0")
        if marked and fields and fields[0] != "Z":
            found.append(pid)
    return found


@pytest.mark.slow
def test_train_local_trains_debug_config_on_two_cpu_processes(shakespeare_data, tmp_path):
    """One live run per run folder (issue 27, item 2), through the launcher a user runs.

    A first run trains on 2 processes and is held inside its second checkpoint save (step
    6; steps 1-6 logged, step 3 saved). While it is live, a relaunch on its folder is
    refused by the launcher's preflight, and a bare `python -m train` (no preflight) by
    its rank 0 at start-up, each in one line naming the live run's host and PID. Then
    `kill -9` of the launcher's process group: the workers, in sessions of their own,
    follow their dead torchrun agent within seconds. A relaunch takes over the dead run's
    lease with a warning, resumes from step 3 and logs steps 4-6 with the first run's
    losses (which were uninterrupted up to step 6)."""
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml",
        run_config(shakespeare_data, run_dir, LAUNCHER_SIZED, training={"steps": 20}),
    )
    six_steps = ["--training.steps", "6"]  # an override reaches train: 6 steps, not 20
    env = {k: v for k, v in train_env().items() if k != "NPROC"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU-only machine, whatever this one is
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD_SAVE)
    marker = f"{os.getpid()}-{time.time_ns()}"
    held_env = env | {
        "HOLD_SAVE_DIR": str(hold),
        "HOLD_SAVE_NUMBER": "2",
        "LAUNCH_TEST_MARK": marker,
        "PYTHONPATH": os.pathsep.join([str(hold), env["PYTHONPATH"]]),
    }
    first_log = tmp_path / "first.log"
    with first_log.open("w") as log:
        first = subprocess.Popen(
            [str(TRAIN_LOCAL), str(config), *six_steps],
            env=held_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal gives it
        )
    try:
        _wait_held(hold, 2, first, lambda: first_log.read_text()[-4000:])
        lease = json.loads((run_dir / "lease.json").read_text())
        live = (
            f"in use by a live run (host {socket.gethostname().split('.')[0]} pid {lease['pid']},"
        )
        assert lease["pid"] in _processes_with(marker)

        second = subprocess.run(
            [str(TRAIN_LOCAL), str(config), *six_steps],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr
        lines = second.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and live in lines[0], lines
        assert "[train_local]" not in second.stderr  # refused before torchrun started
        bare = cli("--config", str(config), *six_steps, env=env)
        bare_lines = bare.stderr.splitlines()
        assert bare.returncode == 2 and len(bare_lines) == 1 and live in bare_lines[0], bare_lines

        os.killpg(first.pid, signal.SIGKILL)  # the launcher's whole process group
        first.wait(timeout=30)
        killed_at = time.monotonic()
        while _processes_with(marker):
            assert time.monotonic() - killed_at < 10, (_processes_with(marker), first_log)
            time.sleep(0.1)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)
    print(
        f"all of the killed launch's processes gone {time.monotonic() - killed_at:.1f} s after the kill"
    )
    assert f"error: the launcher of this run (torchrun agent pid {first.pid}) is gone" in (
        first_log.read_text()
    )
    uninterrupted = {r["step"]: r for r in read_metrics(run_dir, "train")}
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5, 6]
    assert run_layout.list_checkpoints(run_dir / "checkpoint")[0] == [3]

    resumed = subprocess.run(
        [str(TRAIN_LOCAL), str(config), *six_steps],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-4000:]
    assert "[train_local] 2 process(es), 0 GPU(s)" in log
    assert "taking over the lease of a run that is not live" in log and "process is gone" in log
    # two data-parallel ranks: global batch = 2 ranks x local batch 2 x accumulation
    shape = re.search(
        r"local batch size 2, global batch size (\d+), gradient accumulation steps (\d+)", log
    )
    assert shape, log[-4000:]
    assert int(shape[1]) == 2 * 2 * int(shape[2])
    records = read_metrics(run_dir, "train")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    for again in records[6:]:
        want = uninterrupted[again["step"]]
        assert again["tokens_seen"] == want["tokens_seen"], (again, want)
        assert math.isclose(again["loss"], want["loss"], rel_tol=1e-5), (again, want)
    assert (run_dir / "checkpoint" / "step-6" / ".metadata").exists()
    assert not (run_dir / "lease.json").exists()  # released at the end

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
    # 4 nodes x 8 GPUs: a global batch the batch rule admits at data-parallel degree 32
    config = write_config(
        tmp_path / "run.toml",
        run_config(
            shakespeare_data,
            tmp_path / "run",
            LAUNCHER_SIZED,
            training={"global_batch_size": 64, "local_batch_size": 2},
        ),
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
        # whole nodes by default: every CPU and all memory (defect 6)
        "--exclusive",
        "--mem=0",
    ):
        assert expected in line, (expected, line)
    assert "--cpus-per-task" not in line  # train.sbatch gives srun the node's CPUs

    # shared nodes: CPUs and memory by flag or environment, no --exclusive
    shared = subprocess.run(
        [sys.executable, str(SUBMIT), "--no-exclusive", "--cpus-per-task", "48"]
        + ["--dry-print", str(config)],
        env=env | {"TRAIN_MEM": "256G"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shared.returncode == 0, shared.stderr
    assert "--cpus-per-task=48 --mem=256G" in shared.stdout and "--exclusive" not in shared.stdout
    unsized = subprocess.run(
        [sys.executable, str(SUBMIT), "--dry-print", str(config)],
        env=env | {"TRAIN_EXCLUSIVE": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unsized.returncode == 2 and "--no-exclusive shares the nodes" in unsized.stderr

    # a config error is caught at submit time, as one line
    bad = subprocess.run(
        [sys.executable, str(SUBMIT), "--dry-print", str(config), "--training.stepz", "7"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "stepz" in bad.stderr

    # with the plan's budgets (RUN/budgets.json, train/reliability/budgets.py): the USR1
    # lead is one step and one save x 3; a shorter --signal-seconds is refused; a --time
    # that cannot fit the first step and a save warns
    from train.config import load_config
    from train.reliability.budgets import PlannedTimes, fingerprint

    run = load_config(str(config), [])
    PlannedTimes(
        fingerprint=fingerprint(run, 32), world_size=32, gpu="H100", accumulation=1,
        step_s={run.training.seq_len: 100.0}, compile_s=120.0, checkpoint_bytes=10**12,
        storage_gb_per_s=5.0, save_s=200.0,
    ).write(run.run_dir)  # fmt: skip
    planned = subprocess.run(
        [sys.executable, str(SUBMIT), "--gpus-per-node", "8", "--time", "0:10:00"]
        + ["--dry-print", str(config)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    assert "--signal=B:USR1@900" in planned.stdout, planned.stdout  # 3 x (100 + 200) s
    assert "warning: --time 0:10:00 cannot fit the first step" in planned.stderr
    short = subprocess.run(
        [sys.executable, str(SUBMIT), "--gpus-per-node", "8", "--signal-seconds", "240"]
        + ["--dry-print", str(config)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert short.returncode == 2 and "--signal-seconds 240 is shorter" in short.stderr
    # the storage is a config key: at 2.5 GB/s the plan's 10^12 bytes take 400 s, not 200,
    # with no new plan; a slower rate the run measured (RUN/save_rate.json) wins over it
    slower = subprocess.run(
        [sys.executable, str(SUBMIT), "--gpus-per-node", "8", "--dry-print", str(config)]
        + ["--checkpoint.storage_gb_per_s", "2.5"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "--signal=B:USR1@1500" in slower.stdout, slower.stdout + slower.stderr  # 3 x (100 + 400)
    from train.reliability.budgets import MeasuredSave

    MeasuredSave(step=40, seconds=100.0, checkpoint_bytes=10**11).write(run.run_dir)  # 1 GB/s
    measured = subprocess.run(
        [sys.executable, str(SUBMIT), "--gpus-per-node", "8", "--dry-print", str(config)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "--signal=B:USR1@3300" in measured.stdout, measured.stdout + measured.stderr


def test_submit_refuses_a_layout_whose_state_exceeds_the_gpu_in_one_line(tmp_path):
    """The 70B config (tp 8) as replica groups of one node (8 ranks, dp_shard 1): a rank's
    fp32 weights, gradients and Adam's moments are 16 bytes a parameter over 8 ranks, with
    the replica sum's gradient buckets 131.5 GiB against an H100's 80 GiB (the planner's
    row). Refused in one line naming the memory and the ranks a group that hold it; the
    plain launch gets the same check."""

    def submit(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(SUBMIT), "--dry-print", "--run-dir", str(tmp_path / "run"),
             *args, str(REPO / "configs" / "llama3_70b_fp8.toml")],
            env=train_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def refused(proc: subprocess.CompletedProcess, *fragments: str) -> None:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        for fragment in fragments:
            assert fragment in proc.stderr, (fragment, proc.stderr)

    refused(
        submit("--replica-groups", "4", "--nodes", "4"),
        "131.5 GiB on 8 ranks a group", "has 80 GiB", "16 ranks a group hold it",
    )  # fmt: skip
    refused(submit("--replica-groups", "4", "--nodes", "5"), "--nodes 5 is not a multiple")
    refused(submit("--nodes", "1"), "131.4 GiB on 8 ranks", "16 ranks hold it")
    refused(submit("--nodes", "1", "--gpu", "b300"), "--gpu 'b300' is not known")
    # a rank per GPU; FP8 on a card without FP8 GEMMs: refused at submit, not on the nodes
    refused(submit("--nodes", "16", "--gpus-per-node", "4", "--nproc-per-node", "8"),
            "--nproc-per-node 8 is more than --gpus-per-node 4")  # fmt: skip
    refused(submit("--nodes", "4", "--gpu", "a100"), "fp8.enable = true on --gpu a100")
    refused(submit("--nodes", "4", "--gpus-per-node", "4"),  # tp 8: every TP group spans 2 nodes
            "parallelism.tp = 8 does not divide the 4 ranks per node")  # fmt: skip
    accepted = submit("--replica-groups", "2", "--nodes", "8")  # 4 nodes a group: 32 ranks
    assert accepted.returncode == 0, accepted.stderr
    assert "TRAIN_GROUP_NODES=4" in accepted.stdout and "TRAIN_GPU=h100" in accepted.stdout
    for fits in (["--nodes", "2"], ["--nodes", "1", "--gpu", "h200"]):  # 65.7 of 80; 131.4 of 141
        assert submit(*fits).returncode == 0, submit(*fits).stderr


def test_submit_prepare_shares_the_sbatch_builder(tmp_path):
    """CPUs and memory per array task, by flag or environment, on every stage's line."""
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "slurm" / "submit_prepare.py")]
        + ["--num-tasks", "2", "--mem", "8G", "--dry-print", "--input", "shakespeare"]
        + ["--train-tokenizer", "300", "--out", str(tmp_path / "data")],
        env=train_env() | {"PREPARE_CPUS_PER_TASK": "4"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[-9] for line in lines] == ["tokenizer", "task", "merge"], lines
    assert all("--cpus-per-task=4 --mem=8G" in line for line in lines), lines
    assert all("--exclusive" not in line for line in lines), lines


NOT_AN_INT = "is not an integer; set it to one or unset it"


@pytest.mark.parametrize(
    ("script", "env", "flags", "message"),
    [
        # the defaults are read while the parser is built, outside the handler: a traceback
        ("submit.py", {"TRAIN_NODES": "many"}, [], f"TRAIN_NODES='many' {NOT_AN_INT}"),
        ("submit_prepare.py", {"PREPARE_CPUS_PER_TASK": "x"}, [], f"TASK='x' {NOT_AN_INT}"),
        # was submitted, and refused on the cluster by train.sbatch
        ("submit.py", {}, ["--port", "70000"], "--port 70000 is not a port number"),
        # were submitted: every array task then failed on them
        ("submit_prepare.py", {}, ["--input", "x"], "--input x: no such file"),
        ("submit_prepare.py", {}, ["--tokenizer", "{tmp}"], "not a Hugging Face tokenizer.json"),
    ],
    ids=["env-submit", "env-submit-prepare", "port", "input", "tokenizer"],
)
def test_submit_bad_input_is_one_line(script, env, flags, message, tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": ')  # torn
    config = tmp_path / "x.toml"
    config.write_text('extends = "' + str(REPO / "configs" / "debug.toml") + '"\n')
    args = [str(config)]
    if script == "submit_prepare.py":
        args = ["--num-tasks", "2", "--input", "shakespeare", "--out", str(tmp_path / "data")]
        args += [] if "--tokenizer" in flags else ["--train-tokenizer", "300"]
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "slurm" / script), "--dry-print", *args]
        + [f.format(tmp=tmp_path) for f in flags],
        env=train_env() | env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: ") and message in out.stderr, out.stderr


def _error_lines(stderr: str) -> list[str]:
    """stderr without the launcher's own "[train_local] N process(es)" line."""
    return [x for x in stderr.splitlines() if not x.startswith("[train_local] ")]


def test_bad_input_through_train_local_is_one_line_before_torchrun(shakespeare_data, tmp_path):
    """Config, world-size and data errors: `python -m train --check` (no torch) stops the
    launcher before torchrun starts, with the one line and exit 2."""
    config = write_config(
        tmp_path / "run.toml", run_config(shakespeare_data, tmp_path / "run", LAUNCHER_SIZED)
    )
    no_data = write_config(
        tmp_path / "no_data.toml",
        run_config(
            shakespeare_data,
            tmp_path / "run",
            LAUNCHER_SIZED,
            dataloader={"mix": [{"path": str(tmp_path / "no_such_data"), "weight": 1.0}]},
            training={"global_batch_size": 6},  # valid at NPROC=3: only the data is wrong
        ),
    )
    env = train_env() | {"NPROC": "3"}
    cases = [
        ([str(config), "--training.stepz", "7"], "training.stepz"),
        ([str(config), "--parallelism.tp", "2"], "world size 3"),  # NPROC reaches the check
        ([str(no_data)], "no_such_data/manifest.json: no manifest"),
    ]
    for args, expected in cases:
        start = time.monotonic()
        proc = subprocess.run(
            [str(TRAIN_LOCAL), *args], env=env, capture_output=True, text=True, timeout=120
        )
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
        assert "[train_local]" not in proc.stdout + proc.stderr  # torchrun never started
        assert time.monotonic() - start < 30


def test_the_preflight_imports_no_torch(shakespeare_data, tmp_path):
    config = write_config(
        tmp_path / "run.toml", run_config(shakespeare_data, tmp_path / "run", LAUNCHER_SIZED)
    )
    probe = (
        "import sys\n"
        "from train.__main__ import main\n"
        f"rc = main(['--check', '--world-size', '2', '--config', {str(config)!r}])\n"
        "print(rc, 'TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], env=train_env(), capture_output=True, text=True
    )
    assert proc.stdout.split() == ["0", "NO-TORCH"], proc.stdout + proc.stderr


# Put first on PYTHONPATH: a `python -m train` training process (not its --check) writes
# its environment, as it is when the process exits, to ENV_AT_EXIT_DIR/{worker,bare}.json.
ENV_AT_EXIT = """
import atexit, json, os, sys

def _dump():
    if "--check" in sys.argv or not sys.argv[0].endswith(os.path.join("train", "__main__.py")):
        return
    kind = "worker" if "TORCHELASTIC_RUN_ID" in os.environ else "bare"
    with open(os.path.join(os.environ["ENV_AT_EXIT_DIR"], kind + ".json"), "w") as fh:
        json.dump(dict(os.environ), fh)

if os.environ.get("ENV_AT_EXIT_DIR"):
    atexit.register(_dump)
"""
LAUNCH_DEFAULTS = (
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_DEBUG",
    "PYTORCH_ALLOC_CONF",
    "GLOO_SOCKET_IFNAME",
)


def test_gpus_that_torch_cannot_use_stop_training_in_one_line(shakespeare_data, tmp_path):
    """Defect 4: a GPU node with a CPU build of torch used to train on CPU, silently. Here
    `nvidia-smi` (a stub on PATH) lists a GPU this CPU torch cannot use: the worker stops
    with one line naming the fix, and torchrun adds no traceback.

    The same worker shows the environment the launcher gives it on a GPU node, and a bare
    `python -m train` on that node gets the same defaults (common/launch_env.py, one home),
    except where the user set a value: that value wins."""
    config = write_config(
        tmp_path / "run.toml", run_config(shakespeare_data, tmp_path / "run", LAUNCHER_SIZED)
    )
    dumps = tmp_path / "env"
    dumps.mkdir()
    (dumps / "sitecustomize.py").write_text(ENV_AT_EXIT)
    env = {
        k: v
        for k, v in train_env().items()
        if k not in ("NPROC", "CUDA_VISIBLE_DEVICES", *LAUNCH_DEFAULTS)
    }
    env["PATH"] = fake_nvidia_smi(tmp_path / "bin", "NVIDIA H100 80GB HBM3")
    env["PYTHONPATH"] = os.pathsep.join([str(dumps), env["PYTHONPATH"]])
    env |= {"ENV_AT_EXIT_DIR": str(dumps), "NCCL_SOCKET_IFNAME": "lo"}  # a multi-homed node
    proc = subprocess.run(
        [str(TRAIN_LOCAL), str(config)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[train_local] 1 process(es), 1 GPU(s) visible" in proc.stderr
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: 1 GPU(s) are visible (GPU 0: NVIDIA H100 80GB HBM3)")
    assert "CPU build of torch" in lines[0] and "scripts/setup.sh --device cuda" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / "checkpoint").exists()

    bare = cli("--config", str(config), env=env | {"NCCL_DEBUG": "INFO"})
    assert bare.returncode == 2 and bare.stderr.splitlines() == lines, bare.stderr
    worker = json.loads((dumps / "worker.json").read_text())
    alone = json.loads((dumps / "bare.json").read_text())
    launched = {key: worker.get(key) for key in LAUNCH_DEFAULTS}
    assert launched == {
        "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),  # one process: every core
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "NCCL_DEBUG": "WARN",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
        "GLOO_SOCKET_IFNAME": "lo",  # from NCCL_SOCKET_IFNAME
    }
    assert {key: alone.get(key) for key in LAUNCH_DEFAULTS} == launched | {"NCCL_DEBUG": "INFO"}


def test_gpus_hidden_by_cuda_visible_devices_do_not_count(tmp_path, monkeypatch):
    """The driver's list, filtered as CUDA would: hidden GPUs let a CPU run go on."""
    from train.compat import cpu_compat

    (tmp_path / "nvidia-smi").write_text(
        "#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-1)'\necho 'GPU 1: NVIDIA H100 (UUID: GPU-2)'\n"
    )
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert len(cpu_compat.visible_gpus()) == 2
    with pytest.raises(ValueError, match=r"^2 GPU\(s\) are visible \(GPU 0: NVIDIA H100, \.\.\.\)"):
        cpu_compat.check_gpus_usable()  # this machine's torch has no CUDA
    for hidden, count in (("1", 1), ("", 0), ("-1", 0)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert len(cpu_compat.visible_gpus()) == count, hidden
    cpu_compat.check_gpus_usable()  # all hidden: training on CPU on purpose


def test_amd_gpus_that_torch_cannot_use_name_the_rocm_build(tmp_path, monkeypatch):
    """The same guard for AMD GPUs (a stand-in amd-smi, and a stand-in for /dev/kfd): the
    fix it names is the ROCm build; HIP's own variable hides them."""
    from common import launch_env
    from tests.utils.amd import MI300X, fake_amd_smi
    from train.compat import cpu_compat

    (tmp_path / "kfd").touch()
    monkeypatch.setattr(launch_env, "KFD", str(tmp_path / "kfd"))
    monkeypatch.setenv("PATH", fake_amd_smi(tmp_path / "bin", MI300X, MI300X))
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError) as refused:
        cpu_compat.check_gpus_usable()  # this machine's torch is a CPU build
    assert str(refused.value).startswith("2 GPU(s) are visible (GPU 0: AMD Instinct MI300X")
    assert "reinstall it with `scripts/setup.sh --device rocm`" in str(refused.value)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    cpu_compat.check_gpus_usable()


def test_torchrun_wrapper_keeps_the_report_of_a_crash(tmp_path):
    """Only the user-error exit code loses torchrun's traceback; a crash keeps it."""
    torchrun = REPO / "scripts" / "slurm" / "torchrun.py"
    results = {}
    for code in (2, 3):
        script = tmp_path / f"exit{code}.py"
        # like train: torchtitan's @record functions write an error file on the way out
        script.write_text(
            "import sys\n"
            "from torch.distributed.elastic.multiprocessing.errors import record\n"
            "@record\n"
            "def build():\n"
            f"    raise ValueError('code {code}')\n"
            "try:\n"
            "    build()\n"
            "except ValueError as e:\n"
            "    print(f'error: {e}', file=sys.stderr)\n"
            f"    sys.exit({code})\n"
        )
        results[code] = subprocess.run(
            [sys.executable, str(torchrun), "--standalone", "--nproc_per_node", "1", str(script)],
            env=train_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert results[2].returncode == 2 and results[2].stderr.splitlines() == ["error: code 2"]
    assert results[3].returncode == 1
    assert "ChildFailedError" in results[3].stderr and "exitcode  : 3" in results[3].stderr


def test_train_sbatch_stops_bad_input_before_srun_without_requeue(shakespeare_data, tmp_path):
    """The batch script's preflight, run as SLURM would start it on the batch host."""
    config = write_config(
        tmp_path / "run.toml", run_config(shakespeare_data, tmp_path / "run", LAUNCHER_SIZED)
    )
    run_dir = tmp_path / "run"
    env = train_env() | {
        "TRAIN_REPO": str(REPO),
        "TRAIN_RUN_DIR": str(run_dir),
        "TRAIN_NPROC_PER_NODE": "2",
        "SLURM_JOB_ID": "17",
        "SLURM_NNODES": "2",
        "PATH": "/usr/bin:/bin",  # no scontrol/srun: the script must stop before them
    }
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm" / "train.sbatch"), str(config)]
        + ["--parallelism.dp_shard", "2", "--fresh"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "world size is 4" in lines[0], proc.stderr  # 2 nodes x 2
    events = (run_dir / "slurm" / "restarts.log").read_text()
    assert "event=bad-input" in events and "not requeued" in events
    assert "event=start" not in events


def test_submit_checks_the_data_before_sbatch(shakespeare_data, tmp_path):
    """Without --dry-print the data is checked too, and that no live run holds the run
    folder; sbatch (a stub here) is not run."""
    config = write_config(
        tmp_path / "run.toml",
        run_config(
            shakespeare_data,
            tmp_path / "run",
            LAUNCHER_SIZED,
            dataloader={"mix": [{"path": str(tmp_path / "no_such_data"), "weight": 1.0}]},
            training={"global_batch_size": 16},  # valid on 1 node x 8 GPUs: only the data is wrong
        ),
    )
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path / 'sbatch-ran'}\necho 1\n")
    (fake_bin / "sbatch").chmod(0o755)
    env = train_env() | {"PATH": f"{fake_bin}:{os.environ['PATH']}"}
    bad = subprocess.run(
        [sys.executable, str(SUBMIT), str(config)], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2, bad.stderr
    lines = bad.stderr.splitlines()
    missing = tmp_path / "no_such_data" / "manifest.json"
    assert len(lines) == 1 and lines[0].startswith(f"error: {missing}: no manifest"), lines
    assert not (tmp_path / "sbatch-ran").exists()

    # good data, but a live run holds the folder (this test process, as far as the lease
    # can tell): refused before the job is queued, in one line naming that run
    good = write_config(
        tmp_path / "good.toml",
        run_config(
            shakespeare_data, tmp_path / "run", LAUNCHER_SIZED, training={"global_batch_size": 16}
        ),
    )
    lease = RunLease(tmp_path / "run")
    lease.acquire()
    try:
        held = subprocess.run(
            [sys.executable, str(SUBMIT), str(good)], env=env, capture_output=True, text=True
        )
    finally:
        lease.release()
    assert held.returncode == 2, held.stderr
    lines = held.stderr.splitlines()
    assert (
        len(lines) == 1
        and f"in use by a live run (host {lease.me.host} pid {os.getpid()}," in lines[0]
    )
    assert not (tmp_path / "sbatch-ran").exists()


# A live run on another node whose clock is SKEW_S behind this one's: it holds the lease and
# beats every second, each beat stamped by its own (skewed) clock.
SKEW_S = 600
SKEWED_HOLDER = """
import dataclasses, os, sys, time
from common.run_lease import Holder, RunLease

class Behind:
    monotonic, sleep = staticmethod(time.monotonic), staticmethod(time.sleep)

    def time(self):
        return time.time() - SKEW_S

me = Holder.this_process(time.time() - SKEW_S, interval_s=1.0)
me = dataclasses.replace(me, host="node-b", machine="node-b|boot-b|pid:[1]")
lease = RunLease(sys.argv[1], clock=Behind(), me=me)
lease.acquire()
lease.start_beating(lambda holder: (print("lease lost", flush=True), os._exit(3)))
print("holding", flush=True)
time.sleep(120)
""".replace("SKEW_S", str(SKEW_S))


def test_a_launch_never_takes_over_a_beating_run_whose_clock_is_behind(shakespeare_data, tmp_path):
    """A second launch against a live run folder held from another machine with a skewed
    clock (10 minutes behind: its beats all look 600 s old here) watches the beat counter
    and is refused in one line; the live run keeps its lease."""
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml", run_config(shakespeare_data, run_dir, LAUNCHER_SIZED)
    )
    run_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", SKEWED_HOLDER, str(run_dir)],
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        held = json.loads((run_dir / "lease.json").read_text())
        assert time.time() - held["beat"] > SKEW_S - 5  # stale by timestamps alone
        second = cli("--config", str(config), env=train_env() | {"CUDA_VISIBLE_DEVICES": ""})
        lines = second.stderr.splitlines()
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert len(lines) == 2 and lines[0].startswith("[lease] "), lines  # then watched
        assert lines[1].startswith("error: ") and (
            f"in use by a live run (host node-b pid {holder.pid}," in lines[1]
        ), lines
        assert holder.poll() is None  # still live, still the holder
        assert json.loads((run_dir / "lease.json").read_text())["token"] == held["token"]
        assert not (run_dir / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


def _log_time(line: str) -> float:
    """Epoch seconds of a torchtitan log line ('[titan] [rank0] 2026-01-01 12:00:00,123 - ...')."""
    stamp = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", line)[0]
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


# Put first on a worker's PYTHONPATH: holds every worker's checkpoint save open (the first,
# or the HOLD_SAVE_NUMBER-th of the process; inside torchtitan's save, before DCP is called),
# each writing its PID to HOLD_SAVE_DIR/held-RANK, until the test writes HOLD_SAVE_DIR/release,
# so the test's signal provably lands during a save instead of racing a fast one. Workers
# only (torchrun sets LOCAL_RANK): the launcher and the preflight stay as they are.
HOLD_SAVE = """
import os

if os.environ.get("HOLD_SAVE_DIR") and "LOCAL_RANK" in os.environ:
    import functools, pathlib, time
    import torch.distributed.checkpoint as dcp

    saves = []

    def _held(save):
        @functools.wraps(save)
        def held(*args, **kwargs):
            folder = pathlib.Path(os.environ["HOLD_SAVE_DIR"])
            saves.append(1)
            held = folder / f"held-{os.environ['RANK']}"  # once per rank (its DCP daemon too)
            if len(saves) == int(os.environ.get("HOLD_SAVE_NUMBER", "1")) and not held.exists():
                held.write_text(str(os.getpid()))
                while not (folder / "release").exists():
                    time.sleep(0.05)
            return save(*args, **kwargs)
        return held

    dcp.save, dcp.async_save = _held(dcp.save), _held(dcp.async_save)
"""


def _wait_held(hold: Path, nproc: int, launch: subprocess.Popen, log=lambda: "") -> list[int]:
    """The PIDs of the `nproc` workers held in a save (rank order), once all are held."""
    deadline = time.monotonic() + 240
    while len(held := sorted(hold.glob("held-*"))) < nproc:
        assert launch.poll() is None and time.monotonic() < deadline, f"never held: {log()}"
        time.sleep(0.05)
    return [int(path.read_text()) for path in held]


@pytest.mark.slow
def test_signal_during_checkpoint_save_leaves_a_loadable_checkpoint(shakespeare_data, tmp_path):
    """SIGUSR1 to one of 2 ranks lands inside a save: the save completes, the ranks agree to
    stop, the next step boundary saves again and exits 0 with preempted.json (a stale one
    from an older run removed at start), and a resume loads it, continues and removes it."""
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml",
        run_config(shakespeare_data, run_dir, LAUNCHER_SIZED, training={"steps": 20}),
    )
    run_dir.mkdir()
    (run_dir / "preempted.json").write_text('{"step": 0}')  # stale marker from an older run
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD_SAVE)
    env = train_env() | {"NPROC": "2"}
    held_env = env | {
        "HOLD_SAVE_DIR": str(hold),
        "PYTHONPATH": os.pathsep.join([str(hold), env.get("PYTHONPATH", str(REPO))]),
    }
    proc = subprocess.Popen(
        [str(TRAIN_LOCAL), str(config)],
        env=held_env,
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
                pids = _wait_held(hold, 2, proc)
                assert not (run_dir / "preempted.json").exists()  # the stale marker was removed
                workers = children_of(proc.pid)  # train_local.sh execs the torchrun agent
                assert all(pid in workers for pid in pids), (pids, workers)
                sent_at = time.time()
                os.kill(pids[1], signal.SIGUSR1)  # rank 1 only: the ranks must agree
                (hold / "release").write_text("")
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
    assert finished and finished[0] > sent_at, "the save was not in progress at the signal"
    preempted = json.loads((run_dir / "preempted.json").read_text())
    assert preempted["signal"] == "SIGUSR1"
    step = preempted["step"]
    assert step < 20, "training ran to the end instead of stopping on the signal"
    assert complete_steps(run_dir) == [3, step]
    assert max(r["step"] for r in read_metrics(run_dir, "train")) == step

    resumed = subprocess.run(
        [str(TRAIN_LOCAL), str(config), "--training.steps", str(step + 2)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert f"Training starts at step {step + 1}" in resumed.stdout + resumed.stderr
    assert not (run_dir / "preempted.json").exists()
    steps = [r["step"] for r in read_metrics(run_dir, "train")]
    assert steps == list(range(1, step + 3)), steps
