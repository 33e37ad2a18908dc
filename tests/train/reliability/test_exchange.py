"""train.reliability.exchange: the step's one all_reduce, its lanes read back, and what a
step of our trainer costs beyond torchtitan's own, and a replica group's beyond ours (syncs,
collectives and torchft's RPCs, counted on two real gloo ranks by
scripts/bench_step_overhead.py's counter)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch

from dataloader.ledger_record import LANE_MASK
from tests.utils.distributed import run_distributed_test
from tests.utils.runs import run_config, write_config
from tests.utils.tiny_model import TINY_TRAIN_MODEL
from train.ledger.recorder import EXACT_ROWS
from train.reliability.exchange import (
    LAYOUT,
    NUM_LANES,
    RankSet,
    StepReport,
    Straggling,
    decode,
    encode,
    rank_keys,
    rank_sets,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import bench_step_overhead  # noqa: E402


def _summed(reports: list[StepReport]):
    """What the exchange gives every rank: each rank's row, summed as its all_reduce does."""
    return decode(torch.stack([encode(r) for r in reports]).sum(0).tolist())


def test_one_row_of_sums_carries_every_verdict():
    top = [LANE_MASK] * 3  # a row whose hash lanes are all at their largest
    rows = EXACT_ROWS // 8  # the most a step may hold, over 8 ranks
    reports = [
        StepReport(
            loss_bad=torch.tensor(r == 3),
            grad_bad=r in (0, 7),
            loss_share=torch.tensor(0.25 * r, dtype=torch.float64),
            step_s=1.0 + r,
            straggling=Straggling(6.0, 3.0, 0.5) if r == 5 else None,
            signal={2: signal.SIGUSR1, 6: signal.SIGTERM}.get(r, 0),
            ledger=[rows, 64 * rows, *(x * rows for x in top)],
        )
        for r in range(8)
    ]
    sums = _summed(reports)
    assert (sums.loss_bad, sums.grad_bad) == (1, 2)
    assert sums.loss_sum == pytest.approx(0.25 * sum(range(8)))
    assert sums.step_s == pytest.approx(sum(1.0 + r for r in range(8)))
    assert (sums.stragglers, sums.straggler_s, sums.straggler_ref_s) == (1, 6.0, 3.0)
    assert sums.straggler_data_s == 0.5
    assert sums.signal == signal.SIGTERM  # SIGTERM wins, as the MAX over signal numbers had it
    # the ledger's lanes are summed exactly at their largest (float64, below 2**53)
    assert sums.ledger == [8 * rows, 8 * 64 * rows, *(8 * x * rows for x in top)]
    assert all(x < 2**53 for x in sums.ledger)
    quiet = _summed([StepReport(False, False, 0.0, 1.0, signal=signal.SIGUSR1)])
    assert (quiet.loss_bad, quiet.grad_bad, quiet.stragglers, quiet.signal) == (
        0,
        0,
        0,
        signal.SIGUSR1,
    )
    assert encode(reports[0]).shape == (NUM_LANES,) == (len(LAYOUT),)


def test_a_rare_step_names_the_lowest_and_highest_flagged_rank():
    """A skipped step names its ranks with one all_reduce MAX: simulated here over 8 ranks."""
    world_size = 8
    flags = {r: [r == 3, r in (1, 2, 6)] for r in range(world_size)}
    keys = torch.stack([rank_keys(flags[r], r, world_size) for r in range(world_size)])
    loss, grad = rank_sets(keys.amax(0).tolist(), [1, 3], world_size)
    assert (str(loss), str(grad)) == ("3", "1 ... 6 (3 ranks)")
    assert grad == RankSet(3, 1, 6)
    assert str(RankSet(2, 0, 1)) == "0, 1" and str(RankSet(0, -1, -1)) == "none"


# --------------------------------------------------------------------------- per-step counts

STEPS, LOG_FREQ = 6, 5  # logged steps 1 and 5; steps 2-4 and 6 log nothing


@pytest.mark.slow
def test_a_step_costs_one_collective_and_one_sync_beyond_torchtitans(shakespeare_data, tmp_path):
    """Our trainer and torchtitan's bare Trainer, on the same config and data, one after
    the other on the same 2 gloo ranks (scripts/bench_step_overhead.py's `measure`): a step
    that logs nothing makes one collective (the exchange) and one host sync (its read)
    beyond torchtitan's own. Before issue 34 it made four of each (the health check's two
    all_reduces and reads, the ledger's, the preemption flag's). Then the same 2 ranks as
    2 replica groups of one rank: the bounds docs/reliability.md states for a replica step."""
    config = write_config(
        tmp_path / "count.toml",
        run_config(
            shakespeare_data,
            tmp_path / "unused",
            model=TINY_TRAIN_MODEL,
            training={"steps": STEPS, "seq_len": 64},
            metrics={"log_freq": LOG_FREQ},
            checkpoint={"enable": False},
            validation={"enable": False},
        ),
    )
    out = tmp_path / "counts"
    with bench_step_overhead.lighthouse(2):  # the replica side: 2 groups of one rank
        run_distributed_test(
            bench_step_overhead.measure, 2, str(config), [], STEPS, str(out), 0, init=False
        )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    summary = bench_step_overhead.summarize(ranks, STEPS, 1, LOG_FREQ)
    counts, extra = summary["counts"], summary["extra"]
    # the counter sees torchtitan's own step: FSDP's all-gathers and reduce-scatters
    assert min(counts["unlogged_collective"]["anchor"]) > 10, counts
    assert extra["unlogged_collective"]["ours-anchor"] == 1, counts
    assert extra["unlogged_sync"]["ours-anchor"] <= 1, (counts, summary["sites"]["ours"])
    assert any(
        "train/reliability/exchange.py" in site for site in summary["sites"]["ours"]["collective"]
    )
    # a replica group's step (every rank a group of one, torchft's real Manager and
    # Lighthouse; docs/reliability.md): the quorum and the commit vote, the gradients'
    # one bucket and the ledger's integers across groups, the reads of both
    replica = summary["sites"]["replica"]
    assert replica["rpc"] == {"quorum @ torchft": STEPS, "should_commit @ torchft": STEPS}
    assert set(counts["unlogged_collective"]["replica"]) == {2}, replica["collective"]
    assert extra["unlogged_sync"]["replica-ours"] <= 2, (counts, replica["sync"])
