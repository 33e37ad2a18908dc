"""train.reliability.health, train.reliability.rollback's rule and train.reliability.faults:
unit checks, the per-step exchange at 1,024 ranks on a fake process group, and real 2-rank
gloo runs.

One torchrun of a tiny model carries every injected fault (to keep CI time down): rank 1
sleeps 1 s at the end of every backward pass, rank 1 alone gets a NaN output at step 3,
and every rank gets one at steps 6-8 with `max_consecutive_nonfinite = 3`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.utils.distributed import fake_world
from tests.utils.runs import REPO, read_metrics, run_config, torchrun, write_config
from tests.utils.tiny_model import TINY_TRAIN_MODEL
from train.config import HealthConfig, load_config
from train.reliability.exchange import NUM_LANES, Straggling
from train.reliability.faults import parse_faults
from train.reliability.health import StragglerStats, TrainingHealth, interval_summary
from train.reliability.rollback import RollbackLRSchedulersContainer, SpikeRule, spike_threshold

# rank 1's sleep per step; asserted as > half of it, so a 0.75 s stall elsewhere cannot flip it
SLEEP_S = 1.5


# --------------------------------------------------------------------------- no process


def test_no_shipped_config_enables_fault_injection():
    configs = sorted((REPO / "configs").glob("*.toml"))
    assert configs
    for path in configs:
        assert "inject_faults" not in path.read_text(), path
        assert load_config(path).health.inject_faults == [], path


@pytest.mark.parametrize(
    "spec, message",
    [
        ("explode rank=1", "unknown fault 'explode'"),
        ("sleep rank=1", "needs rank=R and seconds=S"),
        ("nan rank=0", "needs steps=A-B"),
        ("nan steps=x-3", "bad steps 'x-3'"),
        ("sleep rank=1 seconds=fast", "bad seconds 'fast'"),
        ("sleep rank=1 seconds=1 when=now", "bad argument 'when=now'"),
        ("sleep rank=1 seconds=1 at=lunch", "bad at=lunch"),
        ("nan steps=3 at=save", "bad at=save"),
        ("spike factor=10", "needs sequences=A-B"),
        ("spike sequences=5-9", "needs sequences=A-B (global sequence indices) and factor=F"),
        ("spike sequences=9-5 factor=2", "bad 'spike sequences=9-5 factor=2'"),
        ("spike sequences=5 factor=2 rank=1", "bad 'spike sequences=5 factor=2 rank=1'"),
    ],
)
def test_bad_fault_specs_are_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_faults([spec])


def test_fault_specs_select_ranks_and_steps():
    sleep, nan, save = parse_faults(
        ["sleep rank=1 seconds=0.5", "nan steps=3-4,9", "sleep rank=0 seconds=9 at=save steps=6"]
    )
    assert sleep.applies(1, 7) and not sleep.applies(0, 7) and sleep.seconds == 0.5
    assert sleep.at == "backward" and save.at == "save" and save.applies(0, 6)
    assert [s for s in range(12) if nan.applies(0, s)] == [3, 4, 9]
    assert nan.applies(5, 3)  # no rank: every rank


def test_spike_fault_is_keyed_to_global_sequences():
    (spike,) = parse_faults(["spike sequences=16-19 factor=10"])
    assert spike.kind == "spike" and spike.sequences == (16, 19) and spike.factor == 10


def test_spike_threshold_is_sigmas_of_std_with_a_floor():
    mean, std, threshold = spike_threshold([1.0, 3.0], sigmas=2.0, min_rise=0.5)
    assert (mean, std, threshold) == (2.0, 1.0, 4.0)
    assert spike_threshold([2.0, 2.0], sigmas=6.0, min_rise=0.5)[2] == 2.5  # flat: the floor


def _rule(**kw):
    args = {"window": 4, "warmup": 3, "sigmas": 3.0, "min_rise": 0.1, "steps": 1} | kw
    return SpikeRule(**args)


def test_spike_rule_waits_for_warmup_then_flags_a_rise():
    rule = _rule()
    assert [rule.observe(s, loss) for s, loss in enumerate([5.0, 9.0, 5.1], 1)] == [None] * 3
    assert rule.observe(4, 5.0) is None  # within 3 sigma of a noisy history
    rule = _rule()
    for step, loss in enumerate([5.0, 4.9, 5.0, 4.95], 1):
        assert rule.observe(step, loss) is None
    found = rule.observe(5, 6.0)
    assert found and found[0][:2] == (5, 6.0)
    assert found[0][2] == pytest.approx(4.9625)  # the mean of the last window (4 steps)
    assert rule.observe(6, 4.9) is None  # a falling loss never spikes


def test_spike_rule_needs_consecutive_steps_and_keeps_spikes_out_of_its_history():
    rule = _rule(steps=2)
    for step, loss in enumerate([5.0, 5.0, 5.0], 1):
        rule.observe(step, loss)
    assert rule.observe(4, 8.0) is None  # one spiking step: not yet
    assert rule.observe(5, 5.0) is None  # the run is broken: starts over
    assert rule.observe(6, 8.0) is None
    found = rule.observe(7, 9.0)
    assert [f[0] for f in found] == [6, 7] and found[1][2] == 5.0  # 8.0 never entered
    assert [s for s, _ in rule.history] == [1, 2, 3, 5]


def test_spike_rule_forgets_rolled_back_steps():
    rule = _rule(warmup=2)
    for step in range(1, 5):
        rule.observe(step, 5.0 - 0.1 * step)
    rule.forget_after(2)
    assert [s for s, _ in rule.history] == [1, 2]


def test_rollback_lr_window_lowers_its_steps_through_torchtitans_schedule():
    """health.rollback_lr_*: the container built from its Config runs torchtitan's LR lambda
    (warmup 2 steps, then constant until step 90 here) times the windows; a window added
    later lowers its steps, the optimizer gets the lowered LR at once (`refresh`, as after
    the rollback's checkpoint load), and the schedule is unchanged outside the window."""
    import warnings

    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    model = torch.nn.Linear(2, 2)
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1.0})]
    optimizers = OptimizersContainer.Config(param_groups=groups).build(model_parts=[model])
    schedule = {"warmup_steps": 2, "decay_ratio": 0.1}
    schedulers = RollbackLRSchedulersContainer.Config(**schedule).build(
        optimizers=optimizers, training_steps=100
    )
    assert isinstance(schedulers, RollbackLRSchedulersContainer)
    reference = LRSchedulersContainer.Config(**schedule).build(
        optimizers=OptimizersContainer.Config(param_groups=groups).build(
            model_parts=[torch.nn.Linear(2, 2)]
        ),
        training_steps=100,
    )

    def lr() -> float:
        return optimizers.optimizers[0].param_groups[0]["lr"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lr_scheduler.step() before optimizer.step()
        # without a window: torchtitan's schedule exactly
        assert [s.lr_lambdas[0](e) for s in schedulers for e in range(100)] == [
            s.lr_lambdas[0](e) for s in reference for e in range(100)
        ]
        assert lr() == 0.5  # step 1 of the warmup
        for _ in range(3):
            schedulers.step()  # LR of step 4 now
        assert lr() == 1.0
        schedulers.add_window(4, 5, 0.25)  # a rollback to step 3, 2 steps at a quarter
        schedulers.refresh()
        assert lr() == 0.25
        assert schedulers.get_metrics() == {"lr/AdamW": 0.25}
        schedulers.step()
        assert lr() == 0.25  # step 5
        schedulers.step()
        assert lr() == 1.0  # step 6


def _add(stats: StragglerStats, step_s: list[float], rank: int = 0) -> Straggling | None:
    """One step of every rank's times, seen by `rank`: its window that ended, if any."""
    stats.add(step_s[rank], 0.1 * rank, sum(step_s), len(step_s))
    return stats.take_ended()


def test_straggler_window_needs_a_persistent_lag():
    stats = StragglerStats(window=3, factor=1.5, min_lag_s=0.05)  # rank 2's own rule
    assert _add(stats, [1.0, 1.0, 9.0, 1.0], rank=2) is None  # one slow step (a GC pause)
    assert _add(stats, [1.0] * 4, rank=2) is None
    assert _add(stats, [1.0] * 4, rank=2) is None
    for _ in range(2):
        assert _add(stats, [1.0, 1.0, 1.6, 1.0], rank=2) is None
    assert _add(stats, [1.0, 1.0, 1.0, 1.0], rank=2) is None  # the streak is broken
    for _ in range(2):
        assert _add(stats, [1.0, 1.0, 1.6, 1.0], rank=2) is None
    ended = _add(stats, [1.0, 1.0, 1.6, 1.0], rank=2)
    assert ended == Straggling(pytest.approx(4.8), pytest.approx(3.0), pytest.approx(0.2))
    assert _add(stats, [1.0, 1.0, 1.6, 1.0], rank=2) is None  # once per window
    assert stats.interval_steps == 10 and stats.interval_step_s == pytest.approx(21.6)
    others = StragglerStats(window=3, factor=1.5, min_lag_s=0.05)  # rank 0: never slow
    assert all(_add(others, [1.0, 1.0, 1.6, 1.0]) is None for _ in range(4))
    summary = interval_summary([1.0, 1.0, 1.6, 1.0], [0.0, 0.0, 0.0, 0.25])
    assert summary["health/straggler_rank"] == 2
    assert summary["health/straggler_lag_s"] == pytest.approx(0.6)
    assert summary["health/data_wait_max_s"] == 0.25


def test_straggler_is_judged_against_the_mean_of_the_others():
    """The slowest rank is left out of its own reference: two ranks at 1.0 and 2.0 s, the
    second is 2x the other's; a world of one has no stragglers."""
    stats = StragglerStats(window=1, factor=1.5, min_lag_s=0.05)
    assert _add(stats, [1.0, 2.0], rank=1) == Straggling(2.0, 1.0, pytest.approx(0.1))
    assert _add(stats, [1.0, 2.0], rank=0) is None
    assert _add(stats, [5.0]) is None


def test_straggler_window_ignores_noise_below_min_lag():
    stats = StragglerStats(window=2, factor=1.5, min_lag_s=0.05)
    _add(stats, [0.01, 0.03], rank=1)
    assert _add(stats, [0.01, 0.03], rank=1) is None  # 3x, but 0.02 s per step


# --------------------------------------------------------------------------- 1,024 ranks


class _CollectiveBytes:
    """Bytes of the tensors handed to each collective (c10d op) while active."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        calls = self.calls = []

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "c10d":
                    flat, _ = tree_flatten((args, kwargs))
                    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
                    calls.append((func.overloadpacket.__name__, sum(t.nbytes for t in tensors)))
                return func(*args, **(kwargs or {}))

        self.mode = Recorder()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _health_step_bytes(world_size: int, tmp_path: Path) -> tuple[list, list]:
    """(collectives of one per-step check, collectives of one logged interval) of rank 0
    of a fake process group of `world_size` ranks, with a real model's gradients."""
    import torch.distributed as dist

    with fake_world(world_size):
        model = torch.nn.Linear(16, 16)
        health = TrainingHealth(
            HealthConfig(),
            model_parts=[model],
            device=torch.device("cpu"),
            data_loading_times=[0.01],
            run_folder=tmp_path,
            checkpoint_folder=tmp_path / "checkpoint",
            token_ranks=world_size,
            judge_loss=lambda step, loss: False,
        )
        health.begin_step(1)
        loss = model(torch.ones(2, 16)).sum()
        loss.backward()
        health.after_backward(loss.detach())
        with _CollectiveBytes() as step:
            assert health.check_step() is False
        with _CollectiveBytes() as interval:
            health.metrics(1)
        assert dist.get_world_size() == world_size
    return step.calls, interval.calls


def test_the_per_step_check_moves_the_same_bytes_at_1024_ranks_as_at_8(tmp_path):
    """Issues 27 and 34: the per-step verdicts travel in one fixed-size exchange (one
    all_reduce of NUM_LANES numbers), not an all_gather of a row per rank. Rank 0 of a fake
    process group: the same collective and bytes at W = 8 and W = 1024. The logged
    interval's gather (RUN/rank_times.jsonl, once per log) does grow with W: the recorder
    sees that."""
    step_8, interval_8 = _health_step_bytes(8, tmp_path)
    step_1024, interval_1024 = _health_step_bytes(1024, tmp_path)
    assert [name for name, _ in step_8] == ["allreduce_"]
    assert step_1024 == step_8  # same op, same bytes: NUM_LANES float64 summed
    assert sum(b for _, b in step_1024) == NUM_LANES * 8
    row = 2 * 8  # a rank's mean step time and data wait, float64
    assert sum(b for _, b in interval_8) < 1024 * row <= sum(b for _, b in interval_1024)


# --------------------------------------------------------------------------- real runs


def _load_dcp(path: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    flat: dict = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(torch.load(out, weights_only=False), "")
    return flat


def _changed(a: dict, b: dict) -> list[str]:
    """Names of model and optimizer tensors that differ (data/LR/step state excluded)."""
    keys = [k for k in a if torch.is_tensor(a[k]) and not k.startswith(("dataloader.", "lr_"))]
    assert any(k.startswith("optimizer.") for k in keys) and any(
        k.startswith("layers.") for k in keys
    )
    return [k for k in keys if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def faulty_run(shakespeare_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("health")
    run_dir = tmp / "run"
    config = run_config(
        shakespeare_data,
        run_dir,
        {
            "model": TINY_TRAIN_MODEL,
            "validation": {"enable": False},
            "training": {"steps": 12, "seq_len": 64},
            "checkpoint": {"interval": 1, "keep_last": 0},
            "health": {
                "max_consecutive_nonfinite": 3,
                "straggler_window": 3,
                "straggler_factor": 1.2,
                "inject_faults": [
                    f"sleep rank=1 seconds={SLEEP_S}",
                    "nan steps=3 rank=1",
                    "nan steps=6-8",
                ],
            },
        },
    )
    path = write_config(tmp / "health.toml", config)
    proc = torchrun(path, 2, timeout=600)
    return proc, run_dir, tmp


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(faulty_run):
    proc, run_dir, tmp = faulty_run
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert re.search(r"exitcode\s*:\s*4", out), out[-3000:]  # ExitCode.DIVERGED, not a hang's 3
    diverged = json.loads((run_dir / "diverged.json").read_text())  # train.sbatch: no requeue
    assert diverged["step"] == 8 and diverged["reason"].startswith("step 8: 3 consecutive")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    assert errors[0].startswith("error: step 8: 3 consecutive steps (6-8)")
    assert errors[0].endswith(f"Last good checkpoint: {run_dir / 'checkpoint' / 'step-5'}")
    # the bad batch on rank 1 alone stops the update on every rank
    assert "step 3: non-finite loss on rank(s) 1, non-finite gradients on rank(s) 0, 1" in out

    metrics = {r["step"]: r for r in read_metrics(run_dir)}
    assert sorted(metrics) == list(range(1, 9))  # stopped at step 8
    assert [s for s, r in metrics.items() if r["skipped"]] == [3, 6, 7, 8]
    assert [metrics[s]["nonfinite_skips"] for s in (2, 3, 5, 6, 8)] == [0, 1, 1, 2, 4]

    # a skipped step changes no parameter and no optimizer state; the next step does
    state = {s: _load_dcp(run_dir / "checkpoint" / f"step-{s}", tmp) for s in (2, 3, 4, 5, 8)}
    assert _changed(state[2], state[3]) == []
    assert _changed(state[5], state[8]) == []
    assert any(k.startswith("layers.") for k in _changed(state[3], state[4]))
    assert state[3]["train_state.step"] == 3


@pytest.mark.slow
def test_slow_rank_is_named_in_metrics_rank_times_and_a_warning(faulty_run):
    proc, run_dir, _ = faulty_run
    out = proc.stdout + proc.stderr
    warnings = re.findall(r"straggler: rank (\d+) \(.*?\) took .* per step over the last 3", out)
    assert warnings and set(warnings) == {"1"}, out[-3000:]
    metrics = read_metrics(run_dir)
    assert all(r["straggler_rank"] == 1 for r in metrics)
    assert all(r["straggler_lag_s"] > 0.5 * SLEEP_S for r in metrics)
    rank_times = [
        json.loads(line) for line in (run_dir / "rank_times.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rank_times] == list(range(1, 9))
    for record in rank_times:
        assert len(record["step_s"]) == len(record["wait_s"]) == len(record["data_s"]) == 2
        assert record["step_s"][1] - record["step_s"][0] > 0.5 * SLEEP_S
        assert record["wait_s"][1] == 0 and record["wait_s"][0] > 0.5 * SLEEP_S


# --------------------------------------------------------------------------- hang watchdog

# Small windows keep this test short (its sleeps are most of its time); each is still many
# tiny steps long on a loaded CPU, and each margin below is 3 s or more.
HANG_TIMEOUT_S = 6
VAL_SLEEP_S = 2  # per validation batch, 4 batches: 8 s of validation, every batch progress
SAVE_SLEEP_S = 9  # inside the step-4 save: longer than hang_timeout_s, within its budget
MIN_SAVE_GB_PER_S = 4.2e-4  # this model's ~4 MB checkpoint: ~9.6 s of write budget


@pytest.mark.slow
def test_long_validation_and_save_pass_and_a_stall_inside_a_save_is_named(
    shakespeare_data, tmp_path
):
    """Defect 3 of issue 18: at 70B a validation or a final save outlasts hang_timeout_s
    and was called a hang. Rank 1 makes the step-2 validation (4 batches of 2 s) and the
    step-4 save (9 s) outlast hang_timeout_s = 6 s while progressing: no hang. Then it
    stalls inside the step-6 save: caught after the save's budget, named as the save."""
    run_dir = tmp_path / "run"
    config = run_config(
        Path(shakespeare_data),
        run_dir,
        {
            "model": TINY_TRAIN_MODEL,
            "validation": {"enable": True, "freq": 2, "steps": 4},
            "training": {"steps": 6, "seq_len": 64},
            "checkpoint": {"interval": 2, "keep_last": 0},
            "fault_tolerance": {
                "hang_timeout_s": HANG_TIMEOUT_S,
                "min_save_gb_per_s": MIN_SAVE_GB_PER_S,
            },
            "health": {
                "inject_faults": [
                    f"sleep rank=1 seconds={VAL_SLEEP_S} at=validation steps=2",
                    f"sleep rank=1 seconds={SAVE_SLEEP_S} at=save steps=4",
                    "sleep rank=1 seconds=1000 at=save steps=6",
                ]
            },
        },
    )
    path = write_config(tmp_path / "hang.toml", config)
    proc = torchrun(path, 2, timeout=600)
    out = proc.stdout + proc.stderr

    # the budget the save got, as logged: the step-4 save outlasts the timeout, not it
    extra = re.search(r"watchdog: a checkpoint save may take (\d+) s more", out)
    assert extra, out[-3000:]
    budget_s = HANG_TIMEOUT_S + int(extra.group(1))
    assert HANG_TIMEOUT_S < SAVE_SLEEP_S < budget_s - 5, budget_s

    # the long validation and the long save passed: steps 1-6 trained, step 4 saved,
    # validation ran after step 2 and after step 4
    train_steps = sorted(r["step"] for r in read_metrics(run_dir, "train"))
    assert train_steps == list(range(1, 7)), out[-3000:]
    val_steps = {r["step"] for r in read_metrics(run_dir, "val")}
    assert {2, 4} <= val_steps, out[-3000:]
    assert (run_dir / "checkpoint" / "step-4" / ".metadata").is_file()

    # the stall inside the step-6 save: exit 3, one line naming the save
    assert re.search(r"exitcode\s*:\s*3", out), out[-3000:]  # ExitCode.HANG
    hang = json.loads((run_dir / "hang" / "hang.json").read_text())
    assert hang["where"] == "checkpoint save after step 6" and hang["step"] == 6, hang
    assert hang["allowed_s"] == pytest.approx(budget_s, abs=1), hang
    # the exact allowance, not the log's whole seconds (29.9 s prints as 30)
    assert hang["allowed_s"] <= hang["stalled_s"] < hang["allowed_s"] + 20, hang
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: hang: ")]
    assert len(errors) == 1, out[-3000:]
    assert "none finished checkpoint save after step 6" in errors[0], errors[0]
    dumps = "".join(p.read_text() for p in (run_dir / "hang").glob("*-step6-rank1.txt"))
    # rank 1's own stack shows where it stalled: the injected sleep inside the save window
    assert re.search(r'faults\.py", line \d+ in sleep', dumps), dumps[-3000:]
    assert re.search(r'checkpoint\.py", line \d+ in _save', dumps), dumps[-3000:]
