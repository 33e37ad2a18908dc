"""Run a test function in N real processes with an initialised process group, per backend.

OLMo-core style: `run_distributed_test(fn, world_size, *args, backend=backend)` spawns
`world_size` processes, each calls `torch.distributed.init_process_group(backend)`
(rendezvous on a free local port) and runs `fn(rank, world_size, *args)`. A failure on any
rank fails the test with that rank's traceback. `fn` must be importable (a module-level
function) because processes are spawned. With `init=False` the ranks get torchrun's
environment but no process group, for code that initialises its own (torchtitan's Trainer,
in-process).

Why a backend parameter: CI has no GPU, so every distributed test runs on gloo there, but
the GPU runs users do go through NCCL, which behaves differently (tensors must live on the
rank's GPU, object collectives stage through it). Tests take `backend` from `BACKENDS` (or
`backends(n)` for n ranks):

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_x(backend):
        run_distributed_test(_x_rank, 2, backend=backend)

    def _x_rank(rank, world_size):
        t = torch.ones(3, device=rank_device())  # cuda:LOCAL_RANK under NCCL, cpu under gloo

The rank's code is the same for both; only the device differs. The NCCL param is marked
`gpu` and skipped, with the reason shown under `-rs`, where fewer GPUs than ranks are
visible, so CPU CI pays nothing for it and a GPU box runs it (docs/testing.md). gloo ranks
are CPU ranks on every machine (CUDA is hidden from them), so a GPU box's gloo params check
exactly what CI checks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import traceback
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.io import free_port

#: the backend of this process's rank, set by `_worker` before the test function runs
_rank_backend: str | None = None


def cuda_device_count() -> int:
    """GPUs visible to this process (0 without CUDA); reads NVML, creates no CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless `n` CUDA GPUs are visible: NCCL puts each rank on a GPU of its own."""
    found = cuda_device_count()
    return pytest.mark.skipif(
        found < n, reason=f"NCCL with {n} ranks needs {n} CUDA GPUs; {found} visible"
    )


def backends(world_size: int) -> list:
    """`backend` params for a test that runs up to `world_size` ranks."""
    return [
        pytest.param("gloo", id="gloo"),
        pytest.param("nccl", id="nccl", marks=(pytest.mark.gpu, requires_gpus(world_size))),
    ]


BACKENDS = backends(2)


def rank_device() -> torch.device:
    """This rank's device: `cuda:LOCAL_RANK` under NCCL, the CPU under gloo."""
    if _rank_backend == "nccl":
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def _worker(rank, world_size, port, backend, fn, args, errors, init=True):
    global _rank_backend
    _rank_backend = backend
    # A rank killed by a signal (SIGABRT from C++ std::terminate, SIGSEGV) leaves no Python
    # traceback in `errors`: have it print every thread's stack to stderr as it dies.
    faulthandler.enable(all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if backend == "gloo":
        # before anything in this fresh process touches CUDA: a CPU rank, as in CI
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank_device())  # object collectives stage through it
        if not init:
            fn(rank, world_size, *args)
        else:
            dist.init_process_group(
                backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
            )
            try:
                fn(rank, world_size, *args)
            finally:
                dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    _exit_without_finalizing()


def _exit_without_finalizing() -> None:
    """End a rank that passed: exit handlers run (DCP's daemon is shut down, multiprocessing
    joins its children, stdio is flushed), then the process leaves without interpreter
    finalization. Upstream workaround: in one CI run (2026-11-25, a 2-rank gloo test that had
    passed in every earlier run and in 18 runs since, 12 of them on a loaded machine), rank 0
    died with SIGABRT, "terminate called without an active exception", with no Python error:
    a C++ thread still joinable when finalization destroyed its owner, the teardown race
    pytorch/pytorch#179291 describes for gloo, not behaviour under test. A crash before this
    point (in the test or in destroy_process_group) still fails, and faulthandler prints its
    stacks. Retire it when torch ends c10d's threads before finalization (that PR proposed
    it and was abandoned)."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed_test(
    fn,
    world_size: int,
    *args,
    backend: str = "gloo",
    start_method: str = "spawn",
    init: bool = True,
) -> None:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: use 'gloo' or 'nccl' (BACKENDS)")
    ctx = mp.get_context(start_method)
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, fn, args, errors, init),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    bad_exit = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode != 0]
    if failures or bad_exit:
        details = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures))
        raise AssertionError(f"distributed test failed (exit codes {bad_exit}):\n{details}")


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a process group of `world_size` ranks whose collectives
    do nothing (torch's fake backend): what a rank sends at the real world size, without
    the ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "fake_world needs a process with no process group yet"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
