"""Checkpoints: torchtitan's DCP `CheckpointManager`, with completeness made explicit.

Why a subclass: a DCP checkpoint `RUN/checkpoint/step-N/` is complete only once its
`.metadata` file exists (DCP writes it last, after every rank's shards). torchtitan 0.3.0
already ignores step folders without it when picking the newest, but silently, and its
keep-last-N purge counts them as checkpoints, so a torn folder could push a good one out.
Here an incomplete folder is reported with a warning (never loaded), the purge only counts
complete checkpoints, a checkpoint made by a different model shape is refused with a
one-line error before DCP tries to load it, and `--fresh --overwrite` clears old steps on
rank 0 behind a barrier so no rank resumes from them.

Everything else (what is saved: model, optimizer, LR schedule, train step, dataloader
state; resharding onto another world size or FSDP/TP layout; async saves) is torchtitan's.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.tools.logging import logger

from dataloader.common import parse_step_dir


class CheckpointShapeError(ValueError):
    """RUN/checkpoint holds a checkpoint of another model shape."""


def list_checkpoints(folder: str | Path) -> tuple[list[int], list[int]]:
    """(complete steps, incomplete steps) found in a checkpoint folder, each sorted."""
    folder = Path(folder)
    complete, incomplete = [], []
    if folder.is_dir():
        for child in folder.iterdir():
            step = parse_step_dir(child.name)
            if step is not None and child.is_dir():
                done = (child / ".metadata").is_file() or (
                    child / "model.safetensors.index.json"
                ).is_file()
                (complete if done else incomplete).append(step)
    return sorted(complete), sorted(incomplete)


class RunCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        fresh: bool = False
        """Ignore and delete existing checkpoints (the CLI's --fresh --overwrite)."""

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.fresh = config.fresh
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
                    f"Skipping incomplete checkpoint {Path(folder or self.folder) / f'step-{step}'} "
                    "(no .metadata: the save was interrupted); it will not be loaded"
                )
        return newest

    def _load(self, step: int = -1) -> bool:
        if self.fresh:
            if dist.get_rank() == 0 and Path(self.folder).is_dir():
                logger.warning(f"--fresh --overwrite: deleting {self.folder}")
                shutil.rmtree(self.folder)
            dist.barrier()
            return False
        load_step = self._find_load_step() if step == -1 else step
        if load_step > 0:
            self._check_model_shape(self._create_checkpoint_id(load_step))
        return super()._load(load_step if load_step != -1 else step)

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
        """Save `step` now unless it is already saved, and wait until it is on disk."""
        if self._last_saved != step:
            self._force_save = True
            try:
                self._save(step, last_step=False)
            finally:
                self._force_save = False
        self.maybe_wait_for_saving()

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        if saved:
            self._last_saved = curr_step
        return saved

    _last_saved: int = -1

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
