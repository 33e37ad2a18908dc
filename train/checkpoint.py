"""Checkpoints: torchtitan's DCP `CheckpointManager`, with completeness made explicit.

Why a subclass: a DCP checkpoint `RUN/checkpoint/step-N/` is complete only once its
`.metadata` file exists (DCP writes it last, after every rank's shards). torchtitan 0.3.0
already ignores step folders without it when picking the newest, but silently, and its
keep-last-N purge counts them as checkpoints, so a torn folder could push a good one out.
Here an incomplete folder is reported with a warning (never loaded), the purge only counts
complete checkpoints, a checkpoint made by a different model shape is refused with a
one-line error before DCP tries to load it, and `--fresh --overwrite` clears old steps on
rank 0 behind a barrier so no rank resumes from them. Every save, the preemption save
included, runs inside its hang-watchdog window (`train.save_window`: `hang_timeout_s` plus
the checkpoint's bytes at `min_save_gb_per_s`), and the step that completed a loss spike is
not saved (`skip_next_save`, train/rollback.py).

Async saves (`async_with_pinned_mem`, the default on every device) hand the write to DCP's
checkpoint daemon, one process per rank that torch spawns at the first save. SLURM's
preemption signal (SIGTERM, or SIGUSR1 from `--signal`) goes to every process of the job
step, that daemon included, and by default it would die of it: the preemption save would
then fail. `protect_checkpoint_daemon()` makes the daemon ignore both signals (blocked
from its first instruction, ignored once its Python runs); the trainer decides when it
ends (`close()` sends DCP's own TERMINATE and joins it). The only device difference is the
staging copy: non-blocking device-to-host copies need an accelerator (`cpu_compat`).
That copy also works around a torch 2.13 staging bug (`_WrapperSafeStateDictStager`): a
DTensor that views its storage at an offset, as torchtitan's fused-QKV hook made for `wk`
and `wv` when n_kv_heads == 1, failed the step after every async save.

What a save holds: torchtitan's `ModelWrapper` caches `model.state_dict()` for the whole
run. The model keeps Q, K and V as separate parameters (`train/model.py`), so that cache
only views each rank's own parameter shards: nothing is gathered, in steady state or
during a save. Checkpoints from before that change (fused `wqkv`) still resume: their
optimizer state is split on load (`_FusedQKVOptimizerMigration`).

A Hugging Face folder as `initial_load_path` is read by torchtitan's HF loader through
the llama3 state-dict adapter, with its Q/K permutation run on gathered weights, one at a
time (`_ShardSafeLlama3StateDictAdapter`; train/hf_import.py checks the folder).

Everything else (what is saved: model, optimizer, LR schedule, train step, dataloader
state; resharding onto another world size or FSDP/TP layout) is torchtitan's.
"""

from __future__ import annotations

import atexit
import contextlib
import re
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _async_process_executor as _dcp_executor
from torch.distributed.checkpoint._state_dict_stager import StateDictStager as _StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchtitan.components.checkpointer import AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER
from torchtitan.models.llama3 import Llama3StateDictAdapter
from torchtitan.tools.logging import logger

from common.run_layout import list_checkpoints, step_dir_name
from train.save_window import SaveWindow, SaveWindowConfig

# the signals a scheduler sends every process of a job step when it preempts or ends it
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _checkpoint_daemon_main(*args, **kwargs):
    """The DCP checkpoint daemon's entry point, ignoring the preemption signals first.

    Runs in the freshly spawned daemon, where DCP's class is unpatched (this module is
    imported only to unpickle this function), so the class still holds DCP's own loop.
    """
    from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess

    from train.watchdog import follow_parent

    follow_parent()  # no daemon writes on into RUN after its worker died
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # blocked by the parent around the spawn (see below); ignored from now on
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)
    dcp_main = _AsyncCheckpointProcess.__dict__["_checkpointing_subprocess"].__func__
    assert dcp_main is not _checkpoint_daemon_main, "DCP daemon entry patched in the daemon"
    return dcp_main(*args, **kwargs)


_ORIGINAL_DAEMON_INIT = None


def protect_checkpoint_daemon() -> None:
    """Make DCP's async checkpoint daemon survive SIGTERM/SIGUSR1. Idempotent.

    The daemon is spawned (fork + exec of a fresh interpreter) by
    `_AsyncCheckpointProcess.__init__`, with `_checkpointing_subprocess` as its target.
    Two layers: the parent blocks the signals while it spawns the daemon and waits for
    its start-up (a blocked signal is held, not lost: the trainer's own flag handler runs
    once they are unblocked), so the child starts with them blocked; the child's target,
    `_checkpoint_daemon_main`, then ignores them for good before it runs DCP's loop.
    """
    global _ORIGINAL_DAEMON_INIT
    from torch.distributed.checkpoint import _async_process_executor as executor

    cls = executor._AsyncCheckpointProcess
    if _ORIGINAL_DAEMON_INIT is not None:
        return
    _ORIGINAL_DAEMON_INIT = cls.__init__

    def init_with_signals_blocked(self, *args, **kwargs):
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
        try:
            _ORIGINAL_DAEMON_INIT(self, *args, **kwargs)
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
    executor = _dcp_executor
    daemon = executor._CHECKPOINT_PROCESS
    if daemon is None:
        return
    executor._CHECKPOINT_PROCESS = None
    process = daemon._save_process
    if process.is_alive():
        with contextlib.suppress(OSError, ValueError):
            daemon._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process.join(timeout)
    if process.is_alive():
        logger.warning("checkpoint daemon did not stop after TERMINATE; killing it")
        process.kill()
        process.join()


class _WrapperSafeStateDictStager(_StateDictStager):
    """DCP's staging deep copy, except that a tensor-subclass *wrapper* (DTensor) is never
    mistaken for a tensor with storage of its own.

    torch 2.13's `StateDictStager._offload_tensor` tells the two apart by `x.data_ptr() != 0`:
    a wrapper has no data, so its data_ptr used to be 0 and its inner tensors (a DTensor's
    `_local_tensor`) were staged through its attributes. Since DTensor's wrapper carries its
    local tensor's storage offset (pytorch/pytorch#167597), a DTensor that views its local
    storage at an offset reports `offset * itemsize` there; the stager then copies the
    wrapper's data-less storage and fails with "Attempted to call copy_() on an invalid
    python storage" (raised by the next `maybe_wait_for_staging`, i.e. the next step).
    torchtitan's `FusedQKVLinear` state-dict hook makes such DTensors (`wk`/`wv` are
    slices of one gathered `wqkv`, views at an offset whenever n_kv_heads == 1); our model
    no longer fuses Q/K/V, but any state-dict hook that slices can make them. Wrappers
    here always take the data-less branch of that method (the same few lines as torch's).
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


class _ComputeOrderedStager(DefaultStager):
    """DCP's `DefaultStager`, whose staging copy waits for the compute stream.

    Why: with an accelerator, DCP copies device tensors to host memory on a side stream of
    its own (`_staging_stream`), from a background thread, so that training goes on while
    the copy runs. torch 2.13's stager never orders that stream after the compute stream,
    so the copy could read the weights and Adam state while the optimizer step that wrote
    them is still queued: a checkpoint holding a mix of two steps, silently. (The other
    hazard, the next optimizer step overwriting tensors not yet copied, is already covered:
    torchtitan calls `maybe_wait_for_staging()` before every optimizer step, and the
    staging thread synchronizes its stream before it reports done.)

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


def _pinned_memory_stager():
    """torchtitan's stager for async_with_pinned_mem, except that the copy waits for the
    compute stream (`_ComputeOrderedStager`), that the non-blocking device-to-host copy is
    asked for only where there is a device (DCP refuses it otherwise; on CPU the staging
    copy is a plain copy, in the same background thread), and that the deep copy is
    `_WrapperSafeStateDictStager`."""
    from train import cpu_compat

    stager = _ComputeOrderedStager(
        StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=cpu_compat.staging_non_blocking_copy(),
        )
    )
    own = stager._state_dict_stager
    stager._state_dict_stager = _WrapperSafeStateDictStager(
        pin_memory=own.pin_memory,
        share_memory=own.share_memory,
        pin_memory_min_bytes=own.pin_memory_min_bytes,
    )
    own.close()
    return stager


# an optimizer entry of torchtitan's fused QKV projection, as checkpoints before the split wrote it
_FUSED_QKV_KEY = re.compile(r"^(?P<kind>state|param_groups)\.(?P<prefix>.+\.)wqkv\.(?P<rest>.+)$")


class _FusedQKVOptimizerMigration:
    """Load the optimizer state of a checkpoint written while the model fused Q/K/V.

    Why: until issue 18 the model used torchtitan's `FusedQKVLinear` (one `wqkv`
    parameter). Its model weights were saved as `wq`/`wk`/`wv` already (a state-dict hook
    split them), but the optimizer state is keyed by parameter, so those checkpoints hold
    `optimizer.state.<layer>.wqkv.weight.exp_avg` and friends, which the split model
    (`QKVLinear`: `wq`, `wk`, `wv`) does not have. Without this, such a checkpoint would
    resume with fresh Adam moments for Q/K/V, or fail.

    How: the fused entries are loaded by DCP into placeholders of their stored shape,
    sharded over the parameter's own mesh (`Shard(0)` on every mesh dimension, so no rank
    holds more than its share), then one tensor at a time gathered, split the way
    `FusedQKVLinear._split_qkv_on_save` splits the weight (rows laid out as
    `[n_kv_heads, heads_per_kv + 2, head_dim]`), and copied into the live `wq`/`wk`/`wv`
    state in its own placements. Only that one transient tensor is ever full size, and only
    on this one-time load; every later save writes the split layout.
    """

    def __init__(self, live: dict, stored: dict, model_parts: list[torch.nn.Module]):
        self.live = live
        self.to_load = dict(live)
        self.fused: dict[str, tuple[str, list[str]]] = {}  # key -> (layer prefix, split keys)
        for key in stored:
            if not key.startswith(f"{OPTIMIZER}."):
                continue
            flat_key = key[len(OPTIMIZER) + 1 :]
            match = _FUSED_QKV_KEY.match(flat_key)
            if match is None or flat_key in live:
                continue
            prefix, rest = match["prefix"], match["rest"]
            targets = [f"{match['kind']}.{prefix}{w}.{rest}" for w in ("wq", "wk", "wv")]
            if not all(t in live for t in targets):
                continue
            for target in targets:
                self.to_load.pop(target)
            self.to_load[flat_key] = self._placeholder(stored[key], live[targets[0]])
            self.fused[flat_key] = (prefix, targets)
        self.model_parts = model_parts

    def __bool__(self) -> bool:
        return bool(self.fused)

    @staticmethod
    def _placeholder(meta, like):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor import empty as dtensor_empty

        if not isinstance(meta, TensorStorageMetadata):
            return like  # a param-group value (lr, betas, ...): DCP replaces it
        size, dtype = tuple(meta.size), meta.properties.dtype
        if isinstance(like, DTensor) and size:
            mesh = like.device_mesh
            return dtensor_empty(
                *size, dtype=dtype, device_mesh=mesh, placements=[Shard(0)] * mesh.ndim
            )
        if isinstance(like, DTensor):
            return dtensor_empty(
                *size, dtype=dtype, device_mesh=like.device_mesh, placements=like.placements
            )
        return torch.empty(size, dtype=dtype, device=like.device)

    def _head_dim(self, prefix: str) -> int:
        for part in self.model_parts:
            try:
                return part.get_submodule(prefix.rstrip(".")).head_dim
            except AttributeError:
                continue
        raise AssertionError(f"no Q/K/V projection {prefix!r} in the model")

    def finish(self) -> dict:
        """The live flat optimizer state dict, every entry loaded."""
        from torch.distributed.tensor import DTensor, Replicate

        done = {k: v for k, v in self.to_load.items() if k not in self.fused}
        for flat_key, (prefix, targets) in self.fused.items():
            loaded = self.to_load[flat_key]
            if not isinstance(loaded, torch.Tensor):
                for target in targets:
                    done[target] = loaded
                continue
            full = loaded.full_tensor() if isinstance(loaded, DTensor) else loaded
            parts = (full, full, full)  # a scalar (Adam's step) is shared
            if full.ndim:
                live_q, live_k = self.live[targets[0]], self.live[targets[1]]
                head_dim = self._head_dim(prefix)
                n_kv = live_k.shape[0] // head_dim
                per_kv = live_q.shape[0] // live_k.shape[0]
                rows = full.reshape(n_kv, per_kv + 2, head_dim, *full.shape[1:])
                tail = full.shape[1:]
                parts = (
                    rows[:, :per_kv].reshape(-1, *tail),
                    rows[:, per_kv].reshape(-1, *tail),
                    rows[:, per_kv + 1].reshape(-1, *tail),
                )
            for target, part in zip(targets, parts, strict=True):
                live = self.live[target]
                if isinstance(live, DTensor):
                    whole = DTensor.from_local(
                        part, live.device_mesh, [Replicate()] * live.device_mesh.ndim
                    )
                    live.to_local().copy_(whole.redistribute(placements=live.placements).to_local())
                else:
                    live.copy_(part)
                done[target] = live
            del full, parts  # one full tensor at a time
        return done


def _permute_whole_heads(permute, w, n_heads_arg, dim1=None, dim2=None):
    """`permute` (the llama3 adapter's Q/K RoPE row permutation, a view that splits the
    rows into heads) on a sharded weight: gathered, permuted, and resharded into the
    weight's own placements, one tensor at a time.

    Why: torchtitan 0.3.0 applies it to the live, sharded DTensors when it loads a Hugging
    Face folder (`to_hf` makes the load's destinations, `from_hf` undoes it), and DTensor's
    view goes wrong two ways. Sharded over more ranks than the weight has heads, it fails
    ("Cannot unflatten unevenly sharded tensor": Llama 3 8B, with 8 KV heads, on 16 or more
    FSDP ranks; fixed upstream the same way, pytorch/torchtitan#4797, after 0.3.0). Worse,
    under FSDP x TP it can succeed with a strided layout (`_StridedShard` of another split
    factor) that DCP's HF reader then fills with the wrong rows, silently (measured:
    k_proj wrong on FSDP 2 x TP 2, 2 KV heads). Resharded into the parameter's own
    placements, the destination is laid out as every DCP load of that parameter is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(w, DTensor) or all(p.is_replicate() for p in w.placements):
        return permute(w, n_heads_arg, dim1, dim2)
    placements = w.placements
    whole = w.redistribute(placements=[Replicate()] * w.device_mesh.ndim)
    return permute(whole, n_heads_arg, dim1, dim2).redistribute(placements=placements)


class _ShardSafeLlama3StateDictAdapter(Llama3StateDictAdapter):
    """torchtitan's llama3 adapter, whose Q/K permutation is right on any sharding
    (`_permute_whole_heads`); everything else, renaming included, is torchtitan's."""

    def _permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return _permute_whole_heads(super()._permute, w, n_heads_arg, dim1, dim2)

    def _reverse_permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return _permute_whole_heads(super()._reverse_permute, w, n_heads_arg, dim1, dim2)


class CheckpointShapeError(ValueError):
    """RUN/checkpoint holds a checkpoint of another model shape."""


class RunCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        fresh: bool = False
        """Ignore and delete existing checkpoints (the CLI's --fresh --overwrite)."""
        save_window: SaveWindowConfig = field(default_factory=SaveWindowConfig)
        """Every save runs in a hang-watchdog window of this budget (train/save_window.py)."""

    def __init__(self, config: Config, **kwargs):
        if config.enable and config.async_mode == "async_with_pinned_mem":
            protect_checkpoint_daemon()
        adapter = kwargs.get("sd_adapter")
        if type(adapter) is Llama3StateDictAdapter:  # the model spec's; used by HF loads
            kwargs["sd_adapter"] = _ShardSafeLlama3StateDictAdapter(
                adapter.model_config, adapter.hf_assets_path
            )
        super().__init__(config, **kwargs)
        self.fresh = config.fresh
        self.save_window = SaveWindow(
            config.save_window,
            model_parts=kwargs["model_parts"],
            optimizers=kwargs["optimizers"],
            enabled=config.enable,
        )
        self._skip_next_save = False
        self._force_save = False
        self._warned_incomplete: set[int] = set()

    # ---- picking the newest complete checkpoint
    def _find_load_step(self, folder: str = "") -> int:
        complete, incomplete = list_checkpoints(folder or self.folder)
        newest = complete[-1] if complete else -1
        for step in incomplete:
            if step > newest and step not in self._warned_incomplete:
                self._warned_incomplete.add(step)
                logger.warning(
                    f"Skipping incomplete checkpoint {Path(folder or self.folder) / step_dir_name(step)} "
                    "(no .metadata: the save was interrupted); it will not be loaded"
                )
        return newest

    def _load(self, step: int = -1) -> bool:
        if self.fresh:
            self.fresh = False  # the start only: a later load (a loss-spike rollback) loads
            if dist.get_rank() == 0 and Path(self.folder).is_dir():
                logger.warning(f"--fresh --overwrite: deleting {self.folder}")
                shutil.rmtree(self.folder)
            dist.barrier()
            return False
        load_step = self._find_load_step() if step == -1 else step
        if load_step > 0:
            self._check_model_shape(self._create_checkpoint_id(load_step))
        return super()._load(load_step if load_step != -1 else step)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        """torchtitan's load, with the optimizer state of a fused-QKV checkpoint migrated
        (`_FusedQKVOptimizerMigration`)."""
        optimizer = state_dict.get(OPTIMIZER)
        if from_hf or optimizer is None:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        from torch.distributed.checkpoint import FileSystemReader

        stored = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
        migration = _FusedQKVOptimizerMigration(
            optimizer.state_dict(), stored, self.states[MODEL].model
        )
        if not migration:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        logger.info(
            f"{checkpoint_id}: optimizer state of fused Q/K/V found (written before the "
            f"split); loading it into wq/wk/wv ({len(migration.fused)} entries)"
        )
        states = {**state_dict, OPTIMIZER: migration.to_load}
        super().dcp_load(states, checkpoint_id, from_hf, from_quantized)
        optimizer.load_state_dict(migration.finish())

    def _check_model_shape(self, checkpoint_id: str) -> None:
        """Refuse a checkpoint whose model tensors have other shapes than ours."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
        for key, value in self.states[MODEL].state_dict().items():
            if not isinstance(value, torch.Tensor):
                continue
            meta = saved.get(key)
            expected = tuple(value.shape)
            if meta is None:
                raise CheckpointShapeError(
                    f"checkpoint {checkpoint_id} has no tensor '{key}': it was made by a different "
                    "model; point job.folder at a new run folder or start over with --fresh --overwrite"
                )
            if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != expected:
                raise CheckpointShapeError(
                    f"checkpoint {checkpoint_id} was made by a different model shape "
                    f"('{key}' is {list(meta.size)} there, {list(expected)} in this config); "
                    "point job.folder at a new run folder or start over with --fresh --overwrite"
                )

    # ---- saving on demand (preemption)
    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self._force_save:
            return self.enable and not self.load_only
        return super()._should_save(curr_step, last_step)

    def save_now(self, step: int) -> None:
        """Save `step` now unless it is already saved, and wait until it is on disk, all
        inside the save's watchdog window."""
        with self.save_window.save(step):
            if self._last_saved != step:
                self._force_save = True
                try:
                    self._save(step, last_step=False)
                finally:
                    self._force_save = False
            self.maybe_wait_for_saving()

    # ---- the save's watchdog window, and a step that must not be saved
    def skip_next_save(self) -> None:
        """The next save call saves nothing: the step completed a loss spike, and was
        rolled back (the trainer's step is now the checkpoint's) or is stopping."""
        self._skip_next_save = True

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self._skip_next_save:
            self._skip_next_save = False
            return False
        with self.save_window.save(curr_step):
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM and self.stager is None:
                self.stager = _pinned_memory_stager()
            saved = super()._save(curr_step, last_step)
        if saved:
            self._last_saved = curr_step
        return saved

    _last_saved: int = -1

    # ---- async staging and the checkpoint daemon
    def _close(self) -> None:
        self.maybe_wait_for_saving()
        super()._close()
        shutdown_checkpoint_daemon()

    # ---- keep-last-N over complete checkpoints only
    def _purge_stale_checkpoints(self):
        if not self._should_purge():
            return
        complete, incomplete = list_checkpoints(self.folder)
        newest = complete[-1] if complete else -1
        # torn folders older than the newest complete checkpoint are garbage
        stale = complete[: -self.keep_latest_k] + [s for s in incomplete if s < newest]
        for step in stale:
            assert self.purge_thread is not None
            self.purge_queue.put(self._create_checkpoint_id(step))
