"""Run a test function in N real processes with an initialised process group.

OLMo-core style: `run_distributed_test(fn, world_size, *args)` spawns
`world_size` processes, each calls `torch.distributed.init_process_group` (gloo
by default, rendezvous on a free local port) and runs `fn(rank, world_size,
*args)`. A failure on any rank fails the test with that rank's traceback.
`fn` must be importable (a module-level function) because processes are spawned.
With `init=False` the ranks get torchrun's environment but no process group, for code that
initialises its own (torchtitan's Trainer, in-process).
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from dataloader.common import free_port


def _worker(rank, world_size, port, backend, fn, args, errors, init=True):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        if not init:
            fn(rank, world_size, *args)
            return
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


def run_distributed_test(
    fn,
    world_size: int,
    *args,
    backend: str = "gloo",
    start_method: str = "spawn",
    init: bool = True,
) -> None:
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
