"""train.reliability.budgets: every time budget from the plan's predicted times, the configured keys
as floors; RUN/budgets.json refused when it was planned for another run; every mesh
group's collective timeout raised at a new seq_len and restored, on a fake process group
of the long-context stage's real size."""

from __future__ import annotations

import json
import math

import pytest

from train.config import ConfigError, load_config
from train.reliability.budgets import (
    TIMEOUT_MARGIN_S,
    Budgets,
    CollectiveTimeouts,
    PlannedTimes,
    fingerprint,
    load_budgets,
)

LONG_CONTEXT = "configs/llama3_8b_long_context.toml"


def _planned(run, world_size=64, **changes) -> PlannedTimes:
    """The long-context stage's plan on 64 H100s, as `--dry-run` predicts it (docs)."""
    fields = dict(
        fingerprint=fingerprint(run, world_size), world_size=world_size, gpu="H100",
        accumulation=8, step_s={8192: 10.47, 32768: 10.65, 65536: 24.78, 131072: 88.43},
        compile_s=120.0, checkpoint_bytes=96_400_000_000, storage_gb_per_s=5.0, save_s=19.3,
    )  # fmt: skip
    return PlannedTimes(**(fields | changes))


def test_the_long_context_stage_passes_check_and_its_128k_phase_fits_its_windows(tmp_path):
    run = load_config(LONG_CONTEXT, [f"--job.folder={tmp_path}"])
    _planned(run).write(run.run_dir)
    budgets = load_budgets(run, 64)  # what --check and every launch read
    assert budgets.planned is not None
    micro_128k = 88.43 / 8
    assert micro_128k < budgets.micro_batch_window_s(131072)
    assert 120.0 + micro_128k <= budgets.compile_window_s(131072)
    # every collective timeout outlasts the windows it must cover
    assert budgets.collective_timeout_s >= budgets.micro_batch_window_s(131072) + 60
    assert budgets.init_timeout_s >= budgets.compile_window_s(131072) + 60
    # SLURM's lead covers one 128K step and one save, with the margin
    assert budgets.signal_lead_s() >= 88.43 + 19.3


def test_a_plan_for_another_world_size_or_a_too_fast_save_floor_is_refused(tmp_path):
    run = load_config(LONG_CONTEXT, [f"--job.folder={tmp_path}"])
    _planned(run).write(run.run_dir)
    with pytest.raises(ConfigError, match=r"planned for world size 64, not 32; plan this run"):
        load_budgets(run, 32)
    # a save floor above the storage's rate: every healthy save would be a hang, plan or not
    with pytest.raises(ConfigError, match=r"min_save_gb_per_s = 20 is above .* at most 5$"):
        load_config(
            LONG_CONTEXT, [f"--job.folder={tmp_path}", "--fault_tolerance.min_save_gb_per_s=20"]
        )
    (run.run_dir / "budgets.json").write_text(json.dumps({"step_s": {}}))
    with pytest.raises(ConfigError, match=r"not a plan's budgets"):
        load_budgets(run, 64)


def test_the_storage_rate_is_a_key_and_a_slower_measured_save_wins(tmp_path):
    """`checkpoint.storage_gb_per_s` re-derives the plan's save with no new plan (the bytes
    are the plan's); a slower rate the run measured (RUN/save_rate.json) replaces it."""
    from train.reliability.budgets import MeasuredSave

    run = load_config(LONG_CONTEXT, [f"--job.folder={tmp_path}"])
    _planned(run).write(run.run_dir)  # at 5 GB/s: 96.4 GB in 19.3 s
    nfs = load_config(
        LONG_CONTEXT,
        [f"--job.folder={tmp_path}", "--checkpoint.storage_gb_per_s=1",
         "--fault_tolerance.min_save_gb_per_s=0.5"],
    )  # fmt: skip
    budgets = load_budgets(nfs, 64)  # the same fingerprint: no new plan needed
    assert budgets.planned.save_s == pytest.approx(96.4)
    assert budgets.signal_lead_s() == math.ceil(3 * (88.43 + 96.4))
    MeasuredSave(step=200, seconds=482.0, checkpoint_bytes=96_400_000_000).write(run.run_dir)
    slower = load_budgets(nfs, 64)  # 0.2 GB/s measured: 482 s
    assert slower.save_s() == pytest.approx(482.0)
    assert slower.signal_lead_s() == math.ceil(3 * (88.43 + 482.0))
    assert "save at measured 0.2 GB/s" in slower.describe()[-1]
    (run.run_dir / "save_rate.json").write_text("{torn")  # a measurement, measured again
    assert load_budgets(nfs, 64).measured is None


def test_editing_fp8_telemetry_between_requeues_keeps_the_plan(run_toml):
    """`python -m train --check`, train.sbatch's bad-input gate before every attempt: a run
    planned with --write-budgets, then `fp8.stats_freq` edited (telemetry, no step time),
    still passes; a recipe change (the step's GEMMs) is another run's plan and is refused.
    A budgets.json fingerprinted on every [fp8] key (before NOT_THE_STEP) still passes."""
    from tests.utils.runs import cli

    config = run_toml()
    run = load_config(config)
    stats_freq = str(run.metrics.log_freq * 2)
    for every_key, edits in ((False, ["--fp8.stats_freq", stats_freq]), (True, [])):
        PlannedTimes(
            fingerprint=fingerprint(run, 1, every_key=every_key), world_size=1, gpu="H100",
            accumulation=1, step_s={run.training.seq_len: 1.0}, compile_s=120.0,
            checkpoint_bytes=10**9, storage_gb_per_s=5.0, save_s=0.2,
        ).write(run.run_dir)  # fmt: skip
        checked = cli("--config", str(config), "--check", *edits)
        assert checked.returncode == 0, checked.stderr[-2000:]
    replanned = cli("--config", str(config), "--check", "--fp8.recipe", "tensorwise")
    assert replanned.returncode == 2, replanned.stderr[-2000:]
    assert "another model, parallelism, batch or seq_len; plan this run again" in replanned.stderr


def test_without_a_plan_the_configured_keys_are_the_budgets(tmp_path):
    run = load_config(LONG_CONTEXT, [f"--job.folder={tmp_path}"])
    budgets = load_budgets(run, 64)
    ft, comm = run.fault_tolerance, run.comm
    assert budgets.micro_batch_window_s(131072) == ft.hang_timeout_s
    assert budgets.compile_window_s() == comm.init_timeout_seconds
    expected = max(comm.train_timeout_seconds, ft.hang_timeout_s + TIMEOUT_MARGIN_S)
    assert budgets.collective_timeout_s == expected
    assert budgets.signal_lead_s() is None


def test_at_a_new_seq_len_every_mesh_group_timeout_is_raised_and_restored(tmp_path):
    """torchtitan's fake process group of 64 ranks, the long-context stage's mesh (CP 8 x
    FSDP 8), built by torchtitan's ParallelDims: the block a new seq_len's step runs in
    raises the timeout of every one-dimensional mesh group and of the default group, and
    the training timeout comes back after it. The fake backend keeps no timeout, so the
    setter handed in records what each group was given."""
    import torch.distributed as dist
    from torchtitan.distributed.parallel_dims import ParallelDims

    from train.runtime import prepare_runtime

    prepare_runtime()  # as every entry point: dist.set_timeout, the CPU's device module
    run = load_config(LONG_CONTEXT, [f"--job.folder={tmp_path}"])
    budgets = Budgets.of(run, _planned(run))
    dist.init_process_group("fake", rank=0, world_size=64)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=8, cp=8, tp=1, pp=1, ep=1, world_size=64)
        dims.build_mesh()
        given: dict[object, list[float]] = {}

        def set_timeout(timeout, group):
            given.setdefault(group, []).append(timeout.total_seconds())

        normal = budgets.collective_timeout_s
        timeouts = CollectiveTimeouts.of_mesh(dims, normal, set_timeout)
        assert {"dp_shard", "cp", "loss", "batch"} <= set(timeouts.groups), timeouts.groups
        needed = budgets.compile_window_s(131072) + TIMEOUT_MARGIN_S  # the trainer's
        assert needed > normal
        with timeouts.raised_to(needed):
            assert {g: v[-1] for g, v in given.items()} == dict.fromkeys(
                timeouts.groups.values(), needed
            )
        assert {g: v for g, v in given.items()} == {
            g: [needed, normal] for g in timeouts.groups.values()
        }
        assert len(given) == len(timeouts.groups)  # every group, the default one too
    finally:
        dist.destroy_process_group()
