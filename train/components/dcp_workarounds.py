"""Workarounds for torch 2.13's async checkpointing (DCP), each until the upstream fix named.

Why a module of its own: `train.components.checkpoint` holds our checkpoint *policy* (which
checkpoint is complete, which one is loaded, when one is saved or purged), which lasts. What
is here is the opposite: code that exists only because of a defect in the pinned torch, and
that should be deleted once torch fixes it. Kept apart, each can name what retires it, and
an upgrade knows what to re-test (tests/test_private_api.py lists the private torch names
each relies on). Not `train.compat.version_compat`: that module fills API a torch version
lacks, once at start-up on every device; these change how DCP's async save behaves, and only
the checkpoint manager asks for them (`RunCheckpointManager`: `protect_checkpoint_daemon`
when it is built, `pinned_memory_stager` at its first async save,
`shutdown_checkpoint_daemon` when it closes).

The workarounds, and what retires each:

1. **The checkpoint daemon dies of the preemption signal** (`protect_checkpoint_daemon`).
   `async_with_pinned_mem` hands every write to DCP's checkpoint daemon, one process per
   rank that torch spawns at the first save. SLURM's preemption signal (SIGTERM, or SIGUSR1
   from `--signal`) goes to every process of the job step, the daemon included, and by
   default it dies of it, so the preemption save (the one that matters most) fails. DCP
   offers no hook on the daemon's signal handling. Retired when DCP's daemon ignores the
   job's signals or lets its caller set them: no upstream fix yet (none found in
   pytorch/pytorch's issues or pull requests, torch 2.13.0's `_async_process_executor.py`).
2. **A DTensor that views its storage at an offset fails the staging copy**
   (`WrapperSafeStateDictStager`). torch's `StateDictStager._offload_tensor` tells a
   tensor-subclass wrapper from a tensor with storage of its own by `data_ptr() != 0`;
   since DTensor carries its local tensor's storage offset (pytorch/pytorch#167597), a
   DTensor viewing its storage at an offset reports a nonzero pointer, and the stager copies
   the wrapper's data-less storage ("Attempted to call copy_() on an invalid python
   storage", raised at the next step). Retired when torch's stager asks
   `is_traceable_wrapper_subclass` instead: no upstream fix yet (torch 2.13.0, and the
   newest pytorch/pytorch source searched for this change, commit 0538272, still test
   `data_ptr() != 0`; no issue or pull request found).
3. **The staging copy does not wait for the optimizer step** (`ComputeOrderedStager`).
   With an accelerator, DCP copies to host memory on a stream of its own from a background
   thread, and torch 2.13's `DefaultStager` never orders that stream after the compute
   stream: the copy can read weights and Adam state that the queued optimizer step has not
   written yet, a checkpoint mixing two steps, silently. Retired when `DefaultStager.stage`
   makes its staging stream wait for the current stream: no upstream fix yet (torch 2.13.0's
   `staging.py`; none found in pytorch/pytorch's issues or pull requests).

`pinned_memory_stager` puts 2 and 3 together for torchtitan's `async_with_pinned_mem`; its
one device difference (no non-blocking copy without an accelerator, which DCP refuses) is
`train.compat.cpu_compat`'s.

What staging costs the host (one shared-memory file descriptor per state-dict tensor for
the run, the node's staging in /dev/shm and pinned RAM) is checked before a launch, by
`train.preflight`; that is torch's design, not a defect, so it is not here.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import signal

import torch
from torch.distributed.checkpoint import _async_process_executor as _dcp_executor
from torch.distributed.checkpoint._state_dict_stager import StateDictStager as _StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchtitan.tools.logging import logger

# the signals a scheduler sends every process of a job step when it preempts or ends it
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


# --------------------------------------------------------------------------- 1. the daemon
def _checkpoint_daemon_main(*args, **kwargs):
    """The DCP checkpoint daemon's entry point, ignoring the preemption signals first.

    Runs in the freshly spawned daemon, where DCP's class is unpatched (this module is
    imported only to unpickle this function), so the class still holds DCP's own loop.
    """
    from common.process import follow_parent

    follow_parent()  # no daemon writes on into RUN after its worker died
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # blocked by the parent around the spawn (see below); ignored from now on
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)
    dcp_main = _dcp_executor._AsyncCheckpointProcess.__dict__["_checkpointing_subprocess"].__func__
    assert dcp_main is not _checkpoint_daemon_main, "DCP daemon entry patched in the daemon"
    return dcp_main(*args, **kwargs)


@functools.cache
def protect_checkpoint_daemon() -> None:
    """Make DCP's async checkpoint daemon survive SIGTERM/SIGUSR1. Idempotent.

    The daemon is spawned (fork + exec of a fresh interpreter) by
    `_AsyncCheckpointProcess.__init__`, with `_checkpointing_subprocess` as its target.
    Two layers: the parent blocks the signals while it spawns the daemon and waits for
    its start-up (a blocked signal is held, not lost: the trainer's own flag handler runs
    once they are unblocked), so the child starts with them blocked; the child's target,
    `_checkpoint_daemon_main`, then ignores them for good before it runs DCP's loop.
    """
    cls = _dcp_executor._AsyncCheckpointProcess
    dcp_init = cls.__init__

    def init_with_signals_blocked(self, *args, **kwargs):
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
        try:
            dcp_init(self, *args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    cls._checkpointing_subprocess = staticmethod(_checkpoint_daemon_main)
    cls.__init__ = init_with_signals_blocked
    # multiprocessing's own exit hook would SIGTERM the (now deaf) daemon and join it
    # forever; end it first through DCP's TERMINATE message (atexit runs last-in first)
    atexit.register(shutdown_checkpoint_daemon)


def shutdown_checkpoint_daemon(timeout: float = 60) -> None:
    """End this process's DCP checkpoint daemon, if one was started; waits for it.
    Imports nothing: it also runs from `__del__` while the interpreter shuts down."""
    daemon = _dcp_executor._CHECKPOINT_PROCESS
    if daemon is None:
        return
    _dcp_executor._CHECKPOINT_PROCESS = None
    process = daemon._save_process
    if process.is_alive():
        with contextlib.suppress(OSError, ValueError):
            daemon._send(_dcp_executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process.join(timeout)
    if process.is_alive():
        logger.warning("checkpoint daemon did not stop after TERMINATE; killing it")
        process.kill()
        process.join()


# --------------------------------------------------------------------------- 2. and 3. staging
class WrapperSafeStateDictStager(_StateDictStager):
    """DCP's staging deep copy, except that a tensor-subclass *wrapper* (DTensor) is never
    mistaken for a tensor with storage of its own (workaround 2 of the module docstring).

    torch 2.13's `StateDictStager._offload_tensor` tells the two apart by `x.data_ptr() != 0`:
    a wrapper has no data, so its data_ptr used to be 0 and its inner tensors (a DTensor's
    `_local_tensor`) were staged through its attributes. A DTensor that views its local
    storage at an offset now reports `offset * itemsize` there, and the stager copies the
    wrapper's data-less storage. torchtitan's `FusedQKVLinear` state-dict hook made such
    DTensors (`wk`/`wv` are slices of one gathered `wqkv`, views at an offset whenever
    n_kv_heads == 1); our model no longer fuses Q/K/V, but any state-dict hook that slices
    can make them. Wrappers here always take the data-less branch of that method (the same
    few lines as torch's).
    """

    def _offload_tensor(self, x, memo, non_blocking=False):
        if type(x) is torch.Tensor or not is_traceable_wrapper_subclass(x):
            return super()._offload_tensor(x, memo, non_blocking=non_blocking)
        staged = x.new_empty(x.size(), device="cpu")
        memo[id(x)] = staged
        inner = dict(vars(x)) if hasattr(x, "__dict__") else {}
        for slot in getattr(x, "__slots__", ()):
            if hasattr(x, slot):
                inner[slot] = getattr(x, slot)
        for name, value in inner.items():
            copy = self.deepcopy_with_tensor_offload(value, memo, non_blocking=non_blocking)
            setattr(staged, name, copy)
        return staged


class ComputeOrderedStager(DefaultStager):
    """DCP's `DefaultStager`, whose staging copy waits for the compute stream (workaround 3
    of the module docstring).

    The other hazard, the next optimizer step overwriting tensors not yet copied, is
    already covered: torchtitan calls `maybe_wait_for_staging()` before every optimizer
    step, and the staging thread synchronizes its stream before it reports done.

    How: `stage()` runs on the training thread, where the current stream is the compute
    stream; it makes the staging stream wait for everything queued on it so far, then hands
    the copy to DCP's thread as before. The same code runs on every device: without an
    accelerator the staging stream is `torch.cpu.Stream`, whose waits are trivially true
    (CPU work is done when it is queued).
    """

    def __init__(self, options: StagingOptions):
        super().__init__(options)
        self._device_module = torch.get_device_module()  # the accelerator's, else torch.cpu
        if self._staging_stream is None:  # DCP makes one only with an accelerator
            self._staging_stream = self._device_module.Stream()

    def stage(self, state_dict, **kwargs):
        self._staging_stream.wait_stream(self._device_module.current_stream())
        return super().stage(state_dict, **kwargs)


def pinned_memory_stager() -> ComputeOrderedStager:
    """torchtitan's stager for async_with_pinned_mem (pinned, shared memory, staged in a
    background thread), except that the copy waits for the compute stream
    (`ComputeOrderedStager`), that the deep copy is `WrapperSafeStateDictStager`, and that
    the non-blocking device-to-host copy is asked for only where there is a device (DCP
    refuses it otherwise; on CPU the staging copy is a plain copy, in the same background
    thread)."""
    from train.compat import cpu_compat

    stager = ComputeOrderedStager(
        StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=cpu_compat.staging_non_blocking_copy(),
        )
    )
    own = stager._state_dict_stager
    stager._state_dict_stager = WrapperSafeStateDictStager(
        pin_memory=own.pin_memory,
        share_memory=own.share_memory,
        pin_memory_min_bytes=own.pin_memory_min_bytes,
    )
    own.close()
    return stager
