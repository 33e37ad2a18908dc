"""scripts/bench_fp8_stats.py's arithmetic: stats-off step time, the extra seconds of a
stats step (booked partly on the step after it), and the run-time ratio. The real run it
measures is the training run of tests/train/test_train_distributed.py; its numbers are
in docs/bench/fp8_stats-2026-11-23.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_fp8_stats import cost  # noqa: E402


def test_cost_separates_stats_steps_and_the_steps_after_them():
    # plain steps 1.0 s; each stats step 1.5 s and the step after it 1.3 s (its log's tail)
    times = {step: 1.0 for step in range(1, 33)}
    times[1] = 9.0  # warm-up, left out
    for step in (10, 20, 30):
        times[step], times[step + 1] = 1.5, 1.3
    result = cost(times, freq=10, warmup=2)
    assert result["stats_steps"] == [10, 20, 30]
    assert result["step_s_off"] == 1.0
    assert result["stats_step_extra_s"] == pytest.approx(0.8)
    assert result["run_time_ratio"] == pytest.approx(10.8 / 10)


def test_cost_refuses_a_run_too_short_to_hold_a_stats_step():
    with pytest.raises(ValueError, match="raise --steps"):
        cost({step: 1.0 for step in range(1, 9)}, freq=10, warmup=2)
