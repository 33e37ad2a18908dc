"""The order of the step (train/trainer.py's essay): the tuple of step hooks that
`train.build.step_hooks` picks, and the order a real step (one rank, in process) calls
their points in.

What the order must keep: the veto runs inside the optimizer step (the exchange's lanes and
the loss judges come after the last backward pass and before the step ends); the FP8 format
switch's gate judges the loss before the spike rule (a loss jump after a resume in another
format stops the run, it does not roll back); the data ledger records the step before the
rollback loads a checkpoint; the step's compute ends in the watchdog only after the
rollback. That a spike step neither saves nor validates is the rollback hook's own
`after_step` (tests/train/reliability/test_rollback.py runs one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.utils.runs import run_config, write_config
from train.build import step_hooks
from train.config import load_config

POINTS = (
    "begin_step",
    "on_batch",
    "before_forward",
    "after_backward",
    "lanes",
    "judge",
    "end_step",
    "after_step",
    "at_boundary",
)


def _names(hooks) -> list[str]:
    return [hook.__name__ for hook in hooks]


def test_the_tuple_is_the_order_of_the_step(run_toml):
    run = load_config(
        run_toml(health={"inject_faults": ["nan steps=2"]}, fp8={"enable": True, "stats_freq": 2})
    )
    names = _names(step_hooks(run))
    assert names == [
        "FaultInjector",
        "TrainingHealth",
        "Fp8Telemetry",
        "FormatSwitchGate",
        "DataLedgerRecorder",
        "LossSpikeRollback",
        "StepWindows",
        "EndInTime",
    ]
    # the gate judges before the spike rule; the ledger records before the rollback, which
    # is done before the watchdog hears the step's compute is over
    assert names.index("FormatSwitchGate") < names.index("LossSpikeRollback")
    assert names.index("DataLedgerRecorder") < names.index("LossSpikeRollback")
    assert names.index("LossSpikeRollback") < names.index("StepWindows")


def test_faults_and_fp8_telemetry_are_hooks_only_when_asked_for(run_toml):
    names = _names(step_hooks(load_config(run_toml(fp8={"enable": False}))))
    assert "FaultInjector" not in names and "Fp8Telemetry" not in names
    assert "TrainingHealth" in names


def test_a_replica_group_swaps_only_the_ledger_recorder(run_toml):
    from train.build import to_trainer_config

    single = load_config(run_toml())
    replica = load_config(run_toml(replica_groups={"reference_slices": [2, 2]}))
    ours, theirs = to_trainer_config(single).hooks, to_trainer_config(replica).hooks
    swapped = [(a.__name__, b.__name__) for a, b in zip(ours, theirs, strict=True) if a is not b]
    assert swapped == [("DataLedgerRecorder", "ReplicaLedgerRecorder")]


def _recording(cls, calls: list):
    """`cls` as a subclass noting each point it is called at: (hook, point, step info)."""

    def point(name):
        def call(self, *args, **kwargs):
            calls.append([cls.__name__, name, kwargs.get("skipped")])
            return getattr(super(sub, self), name)(*args, **kwargs)

        return call

    sub = type(cls.__name__, (cls,), {name: point(name) for name in POINTS})
    return sub


def _steps_ranks(rank, world_size, config_path: str, out: str) -> None:
    from train.runtime import prepare_runtime

    prepare_runtime()
    from train.build import to_trainer_config

    calls: list = []
    config = to_trainer_config(load_config(config_path))
    config.hooks = tuple(_recording(hook, calls) for hook in config.hooks)
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    Path(out).write_text(json.dumps(calls))


def _collapse(points: list[str]) -> list[str]:
    return [p for i, p in enumerate(points) if i == 0 or points[i - 1] != p]


@pytest.mark.slow
def test_a_real_step_calls_the_points_in_the_tuples_order(shakespeare_data, tmp_path):
    """Two steps of one rank, the second's output NaN: every point reaches every hook in
    the tuple's order; the lanes and the judges run inside torchtitan's step (after the last
    backward, before `end_step`); a vetoed step is recorded as skipped and asks no judge."""
    from tests.utils.distributed import run_distributed_test

    config = run_config(
        shakespeare_data,
        tmp_path / "run",
        training={"steps": 2, "global_batch_size": 4},  # 2 micro-batches a step
        health={"inject_faults": ["nan steps=2"]},
        checkpoint={"enable": False},
        validation={"enable": False},
        fault_tolerance={"hang_timeout_s": 0},  # the watchdog is a client of torchrun's store
    )
    path = write_config(tmp_path / "run.toml", config)
    out = tmp_path / "calls.json"
    run_distributed_test(_steps_ranks, 1, str(path), str(out))
    calls = json.loads(out.read_text())
    order = _names(step_hooks(load_config(path)))

    steps: list[list] = [[]]
    for call in calls:
        if call[1] == "at_boundary":  # the boundary before each step, and after the last
            if call[0] == order[-1]:
                steps.append([])
            continue
        steps[-1].append(call)
    assert [len(s) > 0 for s in steps] == [False, True, True, False]
    first, second = steps[1], steps[2]
    micro_batch = ["before_forward", "after_backward"]
    expected = ["begin_step", "on_batch", *micro_batch, *micro_batch, "lanes", "judge"]
    assert _collapse([p for _, p, _ in first]) == [*expected, "end_step", "after_step"]
    for point in POINTS[:-1]:  # each point reaches every hook in the tuple's order
        for step in (first, second):
            hooks = [h for h, p, _ in step if p == point]
            if point in ("on_batch", "before_forward", "after_backward"):
                hooks = hooks[: len(order)]  # the first micro-batch's
            want = [] if point == "judge" and step is second else order
            assert hooks == want, (point, hooks)
    assert {s for _, p, s in first if p == "after_step"} == {False}
    # step 2: non-finite on the one rank: the health check vetoes, no judge is asked, and
    # the ledger records the step as skipped
    assert _collapse([p for _, p, _ in second]) == [*expected[:-1], "end_step", "after_step"]
    assert {s for _, p, s in second if p == "after_step"} == {True}
