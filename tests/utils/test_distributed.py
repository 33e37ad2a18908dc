"""tests/utils/distributed.py itself: each backend param runs real ranks on their own device,
a GPU-less machine reports the NCCL param as skipped with its reason (not silently absent),
and a failing rank fails the test. Every distributed test in the suite relies on these."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.utils.distributed import BACKENDS, cuda_device_count, rank_device, run_distributed_test
from tests.utils.runs import REPO


def _ranks_on_their_device(rank: int, world_size: int, backend: str, parent_pid: int) -> None:
    device = rank_device()
    assert dist.get_backend() == backend
    assert device.type == ("cuda" if backend == "nccl" else "cpu"), device
    # a tensor collective on the rank's device: NCCL refuses CPU tensors, gloo runs them
    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)
    assert total.device == device and total.item() == world_size * (world_size + 1) / 2
    seen = [None] * world_size
    dist.all_gather_object(seen, (rank, os.getpid(), str(device)))
    ranks, pids, devices = zip(*seen, strict=True)
    assert list(ranks) == list(range(world_size))
    assert len(set(pids)) == world_size and parent_pid not in pids, seen  # real processes
    if backend == "nccl":
        assert len(set(devices)) == world_size, seen  # one GPU per rank


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_are_processes_on_their_backend_device(backend):
    run_distributed_test(_ranks_on_their_device, 2, backend, os.getpid(), backend=backend)


def _fails_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 broke on purpose")


def test_a_failing_rank_fails_the_test_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 ---.*rank 1 broke on purpose"):
        run_distributed_test(_fails_on_rank_1, 2, init=False)


def _aborts_on_rank_0(rank: int, world_size: int) -> None:
    dist.barrier()
    if rank == 0:
        os.abort()  # as C++ std::terminate ends a process: SIGABRT, no Python exception


def test_a_rank_killed_by_a_signal_fails_the_test_and_prints_its_stack(capfd):
    """Passing ranks skip interpreter finalization (`_exit_without_finalizing`); a rank that
    dies inside the test function is still a failure, and faulthandler names where."""
    with pytest.raises(AssertionError, match=r"exit codes \[\(0, -6\)\]"):
        run_distributed_test(_aborts_on_rank_0, 2)
    assert "in _aborts_on_rank_0" in capfd.readouterr().err


def test_nccl_param_is_collected_and_skipped_with_its_reason_without_gpus():
    """The GPU run is a real param of the same test: collected everywhere, run where two GPUs
    are visible, reported skipped (with why) elsewhere."""
    test_id = "tests/utils/test_distributed.py::test_ranks_are_processes_on_their_backend_device"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider"]
        + ["--deselect", f"{test_id}[gloo]", test_id],  # gloo runs in this session already
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "1 deselected" in out, out[-3000:]  # the gloo param exists
    if cuda_device_count() >= 2:
        assert proc.returncode == 0 and f"{test_id}[nccl] PASSED" in out, out[-3000:]
    else:
        assert proc.returncode == 0, out[-3000:]
        assert f"{test_id}[nccl] SKIPPED" in out, out[-3000:]
        assert re.search(r"SKIPPED \[1\] .*NCCL with 2 ranks needs 2 CUDA GPUs; [01] visible", out)
