"""Checkpoints: torchtitan's DCP `CheckpointManager`, with completeness made explicit.

Why a subclass: a DCP checkpoint `RUN/checkpoint/step-N/` is complete only once its
`.metadata` file exists (DCP writes it last, after every rank's shards). torchtitan 0.3.0
already ignores step folders without it when picking the newest, but silently, and its
keep-last-N purge counts them as checkpoints, so a torn folder could push a good one out.
Here an incomplete folder is reported with a warning (never loaded), the purge only counts
complete checkpoints and spares one that a loss-spike rollback went back to until spike
forensics has reported on that incident (`common.run_layout.unresolved_rollbacks`: the
replay starts there, and at 70B on 128 GPUs keep_last 2 with saves every 250 steps would
purge it about 71 minutes after the rollback), a checkpoint made by a different model shape is refused with a
one-line error before DCP tries to load it, and `--fresh --overwrite` clears old steps on
rank 0 behind a barrier so no rank resumes from them. A preemption saves the current step on
demand (`save_now`). Every save, the preemption save included, runs inside its hang-watchdog
window (`train.components.save_window`: `hang_timeout_s` plus the checkpoint's bytes at
`min_save_gb_per_s`), and the step that completed a loss spike is not saved
(`skip_next_save`, train/reliability/rollback.py). Before each save writes anything,
`before_save`'s hook runs: the data ledger's records up to that step reach the disk first.

One read of `.metadata` per load: that file describes every rank's shard of every tensor
(at 70B on 128 ranks, about 280,000 shards: 723 parameters x weight and two Adam moments x
128), and every rank needs it three times in a load: the shape check, the check for a
fused-QKV optimizer state, and DCP's own load plan. Each rank unpickles it once
(`_MetadataOnceReader`) and the three share it; the reader is dropped when the load ends.

Async saves (`async_with_pinned_mem`, the default on every device) hand the write to DCP's
checkpoint daemon, one process per rank that torch spawns at the first save, from a copy
staged in shared, pinned host memory. Three defects of torch 2.13 in that path are worked
around in `train.components.dcp_workarounds` (the daemon's preemption signals, and two in
the staging copy), each until the upstream fix it names; what that staging needs of the host
(open files, /dev/shm, RAM) is checked before the launch (`train.preflight.check_host`).

What a save holds: torchtitan's `ModelWrapper` caches `model.state_dict()` for the whole
run. The model keeps Q, K and V as separate parameters (`train/model.py`), so that cache
only views each rank's own parameter shards: nothing is gathered, in steady state or
during a save. Checkpoints from before that change (fused `wqkv`) still resume: their
optimizer state is split on load (`_FusedQKVOptimizerMigration`). A trainer-state key added
since a checkpoint was written (`fp8_format`, the FP8 format it was trained in) is left
out of that checkpoint's load, not refused by DCP as missing.

A Hugging Face folder as `initial_load_path` is read by torchtitan's HF loader through the
model spec's state-dict adapter (`train.components.hf_import.shard_safe_llama3_adapter`, named by
`train.model.build_model_spec`; `train.components.hf_import` also checks the folder before launch).

Everything else (what is saved: model, optimizer, LR schedule, train step, dataloader
state; resharding onto another world size or FSDP/TP layout) is torchtitan's.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torchtitan.components.checkpointer import AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER, TRAIN_STATE
from torchtitan.tools.logging import logger

from common.run_layout import list_checkpoints, step_dir_name, unresolved_rollbacks
from train.components.dcp_workarounds import (
    pinned_memory_stager,
    protect_checkpoint_daemon,
    shutdown_checkpoint_daemon,
)
from train.components.save_window import SaveWindow, SaveWindowConfig


class _MetadataOnceReader(FileSystemReader):
    """DCP's file-system reader of one checkpoint, which unpickles its `.metadata` at the
    first `read_metadata()` and returns that same `Metadata` to every later call (the shape
    check, the fused-QKV check and `dcp.load`'s plan all ask). Only the global metadata is
    kept: a per-rank read (`rank=`, DCP's fallback for checkpoints saved without one) goes
    to the file as before."""

    def __init__(self, path: str):
        super().__init__(path)
        self.metadata_once = None

    def read_metadata(self, *args, **kwargs):
        if args or kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self.metadata_once is None:
            self.metadata_once = super().read_metadata()
        return self.metadata_once


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
        if not isinstance(like, DTensor):
            return torch.empty(size, dtype=dtype, device=like.device)
        mesh = like.device_mesh
        placements = [Shard(0)] * mesh.ndim if size else like.placements
        return dtensor_empty(*size, dtype=dtype, device_mesh=mesh, placements=placements)

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
                tail = full.shape[1:]
                rows = full.reshape(n_kv, per_kv + 2, head_dim, *tail)  # q heads, k, v
                parts = tuple(r.reshape(-1, *tail) for r in rows.split([per_kv, 1, 1], dim=1))
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


class CheckpointShapeError(ValueError):
    """RUN/checkpoint holds a checkpoint of another model shape."""


class RunCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        fresh: bool = False
        """Ignore and delete existing checkpoints (the CLI's --fresh --overwrite)."""
        save_window: SaveWindowConfig = field(default_factory=SaveWindowConfig)
        """Every save runs in a hang-watchdog window of this budget (train/components/save_window.py)."""

    def __init__(self, config: Config, **kwargs):
        if config.enable and config.async_mode == "async_with_pinned_mem":
            protect_checkpoint_daemon()
        super().__init__(config, **kwargs)
        self.fresh = config.fresh
        self.save_window = SaveWindow(
            config.save_window,
            model_parts=kwargs["model_parts"],
            optimizers=kwargs["optimizers"],
            enabled=config.enable,
            run_dir=kwargs.get("base_folder", ""),
        )
        self._skip_next_save = False
        self._force_save = False
        self._warned_incomplete: set[int] = set()
        self._kept_for_forensics: set[int] = set()  # said once each
        self._load_readers: dict[str, _MetadataOnceReader] = {}  # during one load only

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
        try:
            if load_step > 0:
                self._check_model_shape(self._create_checkpoint_id(load_step))
            return super()._load(load_step)  # -1 only when `step` was -1 too
        finally:
            self._load_readers.clear()  # the metadata is read again at the next load

    def _reader(self, checkpoint_id: str) -> _MetadataOnceReader:
        """The one reader (and so the one `.metadata` read) of `checkpoint_id` in this load."""
        key = str(checkpoint_id)
        if key not in self._load_readers:
            self._load_readers[key] = _MetadataOnceReader(key)
        return self._load_readers[key]

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        """torchtitan's load, through this load's one reader of `checkpoint_id`, with the
        optimizer state of a fused-QKV checkpoint migrated (`_FusedQKVOptimizerMigration`).
        A Hugging Face folder is torchtitan's path unchanged (its own storage reader)."""
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        import torch.distributed.checkpoint as dcp

        reader = self._reader(checkpoint_id)
        stored = reader.read_metadata().state_dict_metadata
        optimizer = state_dict.get(OPTIMIZER)
        migration = None
        if optimizer is not None:
            migration = _FusedQKVOptimizerMigration(
                optimizer.state_dict(), stored, self.states[MODEL].model
            )
        if migration:
            logger.info(
                f"{checkpoint_id}: optimizer state of fused Q/K/V found (written before the "
                f"split); loading it into wq/wk/wv ({len(migration.fused)} entries)"
            )
            state_dict = {**state_dict, OPTIMIZER: migration.to_load}
        # the trainer's state may hold keys newer than the checkpoint (`fp8_format`, the
        # format-switch gate's): load the ones it has, the trainer keeps its defaults
        trainer = state_dict.get(TRAIN_STATE)
        older_train_state = None
        if trainer is not None:
            wanted = trainer.state_dict()
            if any(f"{TRAIN_STATE}.{key}" not in stored for key in wanted):
                older_train_state = {
                    k: v for k, v in wanted.items() if f"{TRAIN_STATE}.{k}" in stored
                }
                state_dict = {**state_dict, TRAIN_STATE: older_train_state}
        # torchtitan's non-HF branch of `CheckpointManager.dcp_load` (DCP's load, then the
        # flattened model state into the model), handed the reader instead of the path
        dcp.load(state_dict, storage_reader=reader)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
        if migration:
            optimizer.load_state_dict(migration.finish())
        if older_train_state is not None:
            trainer.load_state_dict(older_train_state)

    def _check_model_shape(self, checkpoint_id: str) -> None:
        """Refuse a checkpoint whose model tensors have other shapes than ours."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        saved = self._reader(checkpoint_id).read_metadata().state_dict_metadata
        for key, value in self.states[MODEL].state_dict().items():
            if not isinstance(value, torch.Tensor):
                continue
            meta = saved.get(key)
            if meta is None:
                why = f"has no tensor '{key}': it was made by a different model"
            elif isinstance(meta, TensorStorageMetadata) and meta.size != value.shape:
                why = (
                    f"was made by a different model shape ('{key}' is {list(meta.size)} "
                    f"there, {list(value.shape)} in this config)"
                )
            else:
                continue
            raise CheckpointShapeError(
                f"checkpoint {checkpoint_id} {why}; point job.folder at a new run folder or "
                "start over with --fresh --overwrite"
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

    def before_save(self, hook) -> None:
        """`hook(step)` runs on every rank before each save writes anything (the data
        ledger's records up to the step reach the disk first: train/ledger/recorder.py)."""
        self._before_save = hook

    _before_save = None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self._skip_next_save:
            self._skip_next_save = False
            return False
        if self._before_save is not None and self._should_save(curr_step, last_step):
            self._before_save(curr_step)
        with self.save_window.save(curr_step):
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM and self.stager is None:
                self.stager = pinned_memory_stager()
            saved = super()._save(curr_step, last_step)
            if saved:  # timed to its last byte on disk: the run's real save rate
                self.save_window.measure(curr_step, self.save_future)
        if saved:
            self._last_saved = curr_step
        return saved

    _last_saved: int = -1

    # ---- async staging and the checkpoint daemon
    def _close(self) -> None:
        self.maybe_wait_for_saving()
        super()._close()
        shutdown_checkpoint_daemon()

    # ---- keep-last-N over complete checkpoints only, past those forensics still needs
    def _purge_stale_checkpoints(self):
        if not self._should_purge():
            return
        complete, incomplete = list_checkpoints(self.folder)
        newest = complete[-1] if complete else -1
        # a checkpoint a loss-spike rollback went back to is where `python -m
        # train.forensics` replays that incident from: kept until its report exists
        needed = unresolved_rollbacks(Path(self.folder).parent)
        old = complete[: -self.keep_latest_k]
        for step in old:
            if step in needed and step not in self._kept_for_forensics:
                self._kept_for_forensics.add(step)
                logger.info(
                    f"keep_last: keeping {Path(self.folder) / step_dir_name(step)}, which "
                    f"incident {needed[step]} rolled back to, until `python -m train.forensics "
                    f"{Path(self.folder).parent} --incident {needed[step]}` has reported on it"
                )
        # torn folders older than the newest complete checkpoint are garbage
        stale = [s for s in old if s not in needed] + [s for s in incomplete if s < newest]
        for step in stale:
            assert self.purge_thread is not None
            self.purge_queue.put(self._create_checkpoint_id(step))
