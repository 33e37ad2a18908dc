"""The forensics replay: torchtitan's own training, rerun from a checkpoint up to a spike.

Why a trainer and not a model loader: to rank the documents of a spiking step, their
losses must be those of the weights the run had *at that step*, which exist nowhere on
disk: the checkpoint gone back to is older, and the rollback threw the steps since away.
So the replay trains again, from that checkpoint, the steps the run trained into the spike:
torchtitan's `Trainer.train()` with the run's own config (RUN/config.toml through
`train.build.to_trainer_config`, at the world size of this launch), its CheckpointManager
loading the checkpoint (DCP reshards onto any number of ranks), its `train_step` with the
same data, LR schedule and loss. The data is the same because the loader's state comes
from the checkpoint and the skip ranges and quarantines in force are those RUN/incidents.jsonl
held before the incident (train/forensics/__main__.py writes them into the replay's own folder,
where `LossSpikeRollback` reads them at start, as a resume would). On fewer ranks,
gradient accumulation absorbs the difference under the same global batch, within fp32
tolerance (tests/train/forensics/test_forensics.py compares the losses with the run's).

What `ForensicsTrainer` adds to `RunTrainer` (a subclass picked by its `Config`, as
`train.build` picks every component; no method of a built object is replaced):
- it stops after the spike's last step (`should_continue_training`), and never saves
  (train/forensics/__main__.py sets `checkpoint.load_only`);
- on each spiking step, before a micro-batch's own forward and backward, it scores the
  micro-batch: one more forward under `no_grad` with the same weights, the model's hidden
  states through its output layer a chunk of the sequence at a time (torchtitan's chunked
  loss never holds all the logits; neither does this), and torchtitan's
  `compute_logprobs` (vocab-parallel under TP) for each token's loss, without any injected
  fault factor. Each row keeps its global sequence, dataset, epoch and on-disk start
  (`last_sequences`/`last_origins` of the loader, noted as the batch is drawn) and the
  loader's positions;
- `gather_scores` brings every rank's rows to rank 0.

The extra forward changes no state: no gradient, no optimizer or scale update, and the
token count torchtitan keeps is restored. Not supported: pipeline parallelism and context
parallelism (a row would be split across ranks); `python -m train.forensics` refuses
`cp > 1` in one line (the schema has no pipeline degree).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.components.loss import compute_logprobs

from train.forensics.report import ScoredRow
from train.reliability.faults import FaultInjector
from train.trainer import RunTrainer


@dataclass
class ReplayConfig:
    """Which steps the forensics replay trains and scores (train/forensics/__main__.py sets it)."""

    last_step: int = 0
    """Stop after this step (the incident's spike step)."""
    scored_steps: list[int] = field(default_factory=list)
    """Score every row of these steps (the spiking steps)."""
    score_chunks: int = 8
    """Sequence chunks the output layer is applied to at a time (bounds the logits held)."""


class ForensicsTrainer(RunTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(RunTrainer.Config):
        replay: ReplayConfig = field(default_factory=ReplayConfig)

    def __init__(self, config: Config):
        super().__init__(config)
        # whole rows on one rank: train/forensics/__main__.py refuses cp > 1 in one line
        assert not (self.parallel_dims.pp_enabled or self.parallel_dims.cp_enabled)
        self.replay = config.replay
        self.scored_rows: list[ScoredRow] = []
        self.faults = FaultInjector(config.health.inject_faults)  # a test's spike, undone
        # (global sequences, origins) of each micro-batch drawn this step, in order
        self._drawn: collections.deque[tuple[list[int], list[tuple[int, int, int]]]] = (
            collections.deque()
        )

    def should_continue_training(self) -> bool:
        if self.step >= self.replay.last_step:  # the same step on every rank
            return False
        return super().should_continue_training()

    def train_step(self, data_iterator):
        self._drawn.clear()
        super().train_step(data_iterator)

    def batch_generator(self, data_iterable):
        loader = self.dataloader
        for batch in super().batch_generator(data_iterable):
            self._drawn.append((list(loader.last_sequences), list(loader.last_origins)))
            yield batch

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        sequences, origins = self._drawn.popleft()
        if self.step in self.replay.scored_steps:
            self._score(kwargs["input_dict"], kwargs["labels"], sequences, origins)
        return super().forward_backward_step(**kwargs)

    @torch.no_grad()
    def _score(self, input_dict, labels, sequences, origins) -> None:
        tokens_seen = self.ntokens_seen  # post_dataloading_process counts the tokens
        inputs, targets, extra = self.post_dataloading_process(dict(input_dict), labels)
        self.ntokens_seen = tokens_seen
        with self.train_context():
            hidden = self.model_parts[0](inputs, **extra)
            # torchtitan's chunked loss makes the model skip its output layer and applies
            # it to chunks itself; without it, the model's output is the logits
            head = getattr(self.loss_fn, "lm_head", None)
            size = max(1, hidden.shape[1] // self.replay.score_chunks)
            losses = [
                -compute_logprobs(head(h) if head is not None else h, y)
                for h, y in zip(hidden.split(size, dim=1), targets.split(size, dim=1), strict=True)
            ]
        losses = torch.cat(losses, dim=1).float().cpu().numpy()
        positions = input_dict["positions"].cpu().numpy()
        factor = self.faults.loss_factor(sequences) if self.faults.spikes else 1.0
        rank = dist.get_rank() if dist.is_initialized() else 0
        for row, (sequence, (dataset, epoch, start)) in enumerate(
            zip(sequences, origins, strict=True)
        ):
            self.scored_rows.append(
                ScoredRow(
                    step=self.step,
                    rank=rank,
                    sequence=sequence,
                    dataset=dataset,
                    epoch=epoch,
                    start=start,
                    losses=np.ascontiguousarray(losses[row], dtype=np.float32),
                    positions=np.ascontiguousarray(positions[row], dtype=np.int32),
                    factor=factor,
                )
            )

    def gather_scores(self) -> list[ScoredRow] | None:
        """Every rank's scored rows on rank 0, in global sequence order (None elsewhere)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return sorted(self.scored_rows, key=lambda r: (r.step, r.sequence))
        rank = dist.get_rank()
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(self.scored_rows, gathered, dst=0)
        if rank != 0:
            return None
        # ranks of one tensor-parallel group score the same rows: keep one of each
        rows = {(row.step, row.sequence): row for part in reversed(gathered) for row in part}
        return [rows[key] for key in sorted(rows)]
