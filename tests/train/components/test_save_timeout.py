"""A save may keep ranks waiting on each other longer than `[comm] train_timeout_seconds`
(DCP's gathers at 70B): for the save, the collective timeout covers the watchdog's save
window (train/components/save_window.py), so the watchdog (which names the rank) speaks
first, not an unnamed timeout."""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.utils.distributed import BACKENDS, rank_device, run_distributed_test
from train.components.save_window import SaveWindow, SaveWindowConfig
from train.runtime import prepare_runtime

TRAIN_TIMEOUT_S = 2
LATE_S = 5  # one rank reaches the save's collective this much later than the other


def _late_rank_in_save(rank, world_size, widen):
    # as every entry point: torch 2.13's missing dist.set_timeout, and on CPU torchtitan's
    # device module (the barrier before the training timeout comes back names the device)
    prepare_runtime()
    config = SaveWindowConfig(
        hang_timeout_s=1.0, min_save_gb_per_s=1.0, train_timeout_s=TRAIN_TIMEOUT_S
    )
    window = SaveWindow(config, model_parts=[], optimizers=None, enabled=False)
    window.checkpoint_bytes = 30 * 10**9  # 30 s more at 1 GB/s: a 30 s save window
    covering = window.save(step=4)
    flag = torch.ones(1, device=rank_device())
    # the first collective connects the ranks and creates the backend whose timeout is set;
    # then the training timeout, as torchtitan sets it after step 1
    dist.all_reduce(flag)
    dist.set_timeout(timedelta(seconds=TRAIN_TIMEOUT_S))
    try:
        # the control (widen=False) is the same late rank without the covering timeout
        with covering if widen else contextlib.nullcontext():
            if rank == 1:
                time.sleep(LATE_S)
            dist.all_reduce(flag)
        outcome = "ok"
    except RuntimeError as e:  # gloo: "Timed out waiting ..."
        outcome = f"timeout: {e}"
    if widen:
        assert outcome == "ok", outcome
        # and the training timeout is back after the save
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            if rank == 0:
                dist.all_reduce(flag)  # rank 1 never joins: times out after TRAIN_TIMEOUT_S
            else:
                time.sleep(LATE_S + 1)
                raise RuntimeError("rank 1 skipped the collective on purpose")
        if rank == 0:
            assert time.monotonic() - start < LATE_S, "the training timeout was not restored"
    else:
        assert rank == 1 or outcome.startswith("timeout"), outcome


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("widen", [True, False], ids=["save-window", "control"])
def test_a_late_rank_inside_a_save_does_not_hit_the_training_timeout(backend, widen):
    run_distributed_test(_late_rank_in_save, 2, widen, backend=backend)
