"""train.reliability.time_limit: the run ends itself before SLURM's end time.

The rule on fake clocks (which step stops, with which step and save times), then the real
thing: `python -m train` with `SLURM_JOB_END_TIME` in its environment, as a SLURM job's
workers have it, and a slow first save; it measures the save, stops in time, saves and
exits 0 with RUN/preempted.json, the path train.sbatch requeues (the local SLURM cluster's
tests cover the requeue itself, tests/scripts/test_slurm_multinode.py)."""

from __future__ import annotations

import json
import re
import time

import pytest

from train.reliability.budgets import STEP_MARGIN, Budgets, MeasuredSave
from train.reliability.time_limit import EndInTime, job_end_time

GB = 10**9


class _Clocks:
    """Wall clock and monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def wall(self) -> float:
        return self.now

    def mono(self) -> float:
        return self.now


def _budgets(storage_gb_per_s: float = 5.0, measured: MeasuredSave | None = None) -> Budgets:
    return Budgets(80.0, 300.0, 100.0, storage_gb_per_s=storage_gb_per_s, measured=measured)


def test_the_end_time_comes_from_slurms_variable():
    assert job_end_time({"SLURM_JOB_END_TIME": "1764201600"}) == 1764201600.0
    for unusable in ("", "Unknown", "0", "-5", "inf", "nan"):
        assert job_end_time({"SLURM_JOB_END_TIME": unusable}) is None, unusable
    assert job_end_time({}) is None


def test_the_run_stops_at_the_first_boundary_within_the_margin_of_a_step_and_a_save():
    """Steps of 2 s after a 60 s first step (compile: not a step time), a save measured at
    10 s: the run stops at the first boundary with under 3 x (2 + 10) = 36 s left, and
    not before; that leaves the save its time and more."""
    clocks = _Clocks()
    end = clocks.now + 200.0
    guard = EndInTime(end, _budgets(), clock=clocks.wall, monotonic=clocks.mono)
    nbytes = 50 * GB
    assert guard.reason(0, [], False, 0) == ""
    clocks.now += 60.0  # step 1: compiles
    assert guard.reason(1, [], False, nbytes) == ""
    stopped_at = None
    for step in range(2, 200):
        clocks.now += 2.0
        saves = [MeasuredSave(2, 10.0, nbytes)] if step == 2 else []
        why = guard.reason(step, saves, False, nbytes)
        if why:
            stopped_at = step
            break
    left = end - clocks.now
    needed = STEP_MARGIN * (2.0 + 10.0)
    assert left <= needed < left + 2.0, (left, needed)  # the first boundary within it
    assert left > 2.0 + 10.0  # a step and a save still fit: it ends in time
    assert stopped_at is not None and "a step 2.0 s + a save 10.0 s) = 36 s" in why, why


def test_a_save_in_flight_counts_twice_and_before_a_save_the_storage_rate_is_the_save():
    clocks = _Clocks()
    nbytes = 100 * GB  # 20 s at the configured 5 GB/s
    guard = EndInTime(clocks.now + 100.0, _budgets(), clock=clocks.wall, monotonic=clocks.mono)
    for step in range(3):  # two measured steps of 1 s after the first
        guard.reason(step, [], False, nbytes)
        clocks.now += 1.0
    # 97 s left: 3 x (1 + 20) = 63 goes on; with a save in flight 3 x (1 + 40) = 123 stops
    assert guard.reason(3, [], False, nbytes) == ""
    clocks.now += 1.0
    why = guard.reason(4, [], True, nbytes)
    assert "a save 20.0 s x 2, one in flight" in why, why
    # an earlier attempt measured 1 GB/s (RUN/save_rate.json): slower than configured, it wins
    slow = EndInTime(None, _budgets(measured=MeasuredSave(7, 50.0, 50 * GB)))
    assert slow.save_s(nbytes) == pytest.approx(100.0)
    assert EndInTime(None, _budgets()).save_s(nbytes) == pytest.approx(20.0)


def test_without_an_end_time_or_a_measured_step_nothing_stops():
    clocks = _Clocks()
    guard = EndInTime(None, _budgets(), clock=clocks.wall, monotonic=clocks.mono)
    for step in range(5):
        assert guard.reason(step, [], True, 10**15) == ""
        clocks.now += 100.0
    late = EndInTime(clocks.now - 1.0, _budgets(), clock=clocks.wall, monotonic=clocks.mono)
    assert late.reason(0, [], False, GB) == ""  # no step finished in this attempt yet
    clocks.now += 30.0
    assert late.reason(1, [], False, GB) == ""  # the first step compiles: not a step time


@pytest.mark.slow
def test_a_run_ends_itself_before_slurms_end_time(run_toml, tmp_path):
    """`python -m train`, as a SLURM job's worker runs it: SLURM_JOB_END_TIME 300 s ahead,
    60 steps of work, and checkpoint storage declared at 0.5 MB/s (the debug model's 50 MB:
    a 100 s save). Once it has timed a step (step 2: step 1 compiles), a step and that
    save, x 3, no longer fit: the verdict rides step 3's exchange (the step's one
    all_reduce, train/reliability/exchange.py), so it stops after step 3, saves (the save's real rate logged and kept in RUN/save_rate.json),
    writes preempted.json (no signal, the reason) and exits 0, well before the end time.
    The arithmetic of when, on fake clocks, is the tests above. The checkpoint daemon meets
    on the run's own store (DCP_USE_PREFIX_STORE, common/launch_env.py), as its log says."""
    from tests.utils.runs import cli, train_env

    run_dir = tmp_path / "run"
    config = run_toml(
        run_dir,
        training={"steps": 60},
        validation={"enable": False},
        checkpoint={"interval": 1000, "storage_gb_per_s": 0.0005},
        fault_tolerance={"min_save_gb_per_s": 0.0005},
    )
    end = time.time() + 300
    proc = cli(
        "--config", str(config), timeout=600,
        env=train_env() | {"SLURM_JOB_END_TIME": str(int(end))},
    )  # fmt: skip
    exited = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert exited < end, f"exited {exited - end:.0f} s after the end time"
    preempted = json.loads((run_dir / "preempted.json").read_text())
    step = preempted["step"]
    assert preempted["signal"] is None and step == 3, preempted
    assert "SLURM_JOB_END_TIME" in preempted["reason"], preempted
    # the save's time came from checkpoint.storage_gb_per_s: ~50 MB at 0.5 MB/s
    save_s = float(re.search(r"a save (\d+\.\d) s", preempted["reason"]).group(1))
    assert 80 < save_s < 120, preempted
    assert (run_dir / "checkpoint" / "step-3" / ".metadata").is_file()
    assert re.search(r"checkpoint step-3: \S+ GB on disk in \d+\.\d s, \S+ GB/s measured", out)
    record = json.loads((run_dir / "save_rate.json").read_text())
    assert record["step"] == 3 and record["checkpoint_bytes"] > 0 and record["gb_per_s"] > 0
    assert "checkpoint background process with prefix store" in out, out[-4000:]
