"""The FP8 format-switch gate (train/reliability/format_switch.py) on its own: fed a real
RUN/metrics.jsonl and the losses after a resume. A switch that continues passes and says
so (the training matrix, tests/train/test_fp8_vs_bf16.py, shows it on two real switches);
one that jumps is vetoed and stops the run in one line; a resume in the same format, or of
a checkpoint written before formats were recorded, is not judged."""

from __future__ import annotations

import logging
import math
import statistics

from common.io import append_jsonl
from common.run_layout import METRICS
from train.config import HealthConfig
from train.reliability.format_switch import SWITCH_CHECK_STEPS, FormatSwitchGate

LOSSES = [6.0 - 0.01 * step + 0.02 * math.sin(step) for step in range(1, 41)]  # a slow fall


def gate(run_dir, fmt="fnuz", rows=LOSSES) -> FormatSwitchGate:
    for step, loss in enumerate(rows, start=1):
        append_jsonl(run_dir / METRICS, {"step": step, "loss": loss})
    append_jsonl(run_dir / METRICS, {"step": 40, "val_loss": 5.9})  # not a training line
    append_jsonl(run_dir / METRICS, {"step": 41, "loss": 9.0})  # after the checkpoint: ignored
    return FormatSwitchGate(HealthConfig(), fmt, run_dir)


def test_a_continuous_switch_passes_and_says_so(tmp_path, caplog):
    g = gate(tmp_path)
    with caplog.at_level(logging.INFO):
        g.on_load(40, "fn")
        for step in range(41, 41 + SWITCH_CHECK_STEPS + 3):
            assert not g.judge(step, LOSSES[-1] + 0.01)
    assert g.stop == "" and g.switch is None
    text = caplog.text
    assert (
        "FP8 format switch at step 40: step-40 was trained in 'fn', this run computes in 'fnuz'"
        in text
    )
    # the reference: steps 1-40's training losses (step 41's 9.0 lies after the checkpoint):
    # the level of the last 5, the step-to-step noise of all 40, the spike rule's margin
    level = statistics.fmean(LOSSES[-5:])
    noise = statistics.pstdev(
        [b - a for a, b in zip(LOSSES[:-1], LOSSES[1:], strict=True)]
    ) / math.sqrt(2)
    bound = level + max(HealthConfig().spike_sigmas * noise, HealthConfig().spike_min_rise)
    assert f"must stay under {bound:.4g} (the last 5 logged losses average {level:.4g}" in text
    assert f"step-to-step noise {noise:.3g} over 40)" in text
    assert bound < LOSSES[-1] + 0.5  # tight: the falling trend is not counted as noise
    assert f"'fn' -> 'fnuz' at step 40: loss continuous (steps 41-{40 + SWITCH_CHECK_STEPS}" in text


def test_a_jump_after_the_switch_is_vetoed_and_stops_the_run(tmp_path, caplog):
    g = gate(tmp_path)
    g.on_load(40, "fn")
    assert not g.judge(41, 5.6)
    assert g.judge(42, 6.3)  # 0.7 above the loss before it: far outside the noise
    assert g.stop.startswith(
        "step 42: loss 6.3 after resuming step-40 (trained in FP8 'fn') in 'fnuz'"
    )
    assert "the checkpoint does not continue in this format" in g.stop
    assert "fp8.format = 'fn' on CPU" in g.stop and "\n" not in g.stop
    assert not g.judge(43, 9.9)  # judged once: the run stops at this step boundary


def test_what_is_not_judged(tmp_path, caplog):
    g = gate(tmp_path)
    g.on_load(40, "fnuz")  # same format: a plain resume, or a rollback
    assert g.switch is None and not g.judge(41, 99.0)
    g.on_load(40, None)  # a checkpoint from before the format was recorded
    assert g.switch is None
    FormatSwitchGate(HealthConfig(), "", tmp_path).on_load(40, "fn")  # FP8 off now: nothing
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with caplog.at_level(logging.INFO):
        lone = gate(fresh, rows=LOSSES[:2])
        lone.on_load(2, "fn")
    assert lone.switch is None and "fewer than 3 logged losses before it: not judged" in caplog.text
