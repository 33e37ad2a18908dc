"""Export from a checkpoint saved by a sharded layout (a real gloo run of `python -m train`).

One FSDP2xTP2 run on 4 ranks resumes the session's trained single-rank checkpoint
(conftest's `trained`) at lr=0 for one step, validates, and saves the same weights in its
own layout: every parameter split by FSDP2 across 2 data-parallel ranks and by TP across 2,
one shard file per rank. From that checkpoint:

- the export is bit-identical to the single-rank checkpoint's export (DCP reshards on load,
  whatever layout saved it), and
- the exported model, run in-process by transformers on the trainer's validation windows,
  reaches the `val_loss` the trainer logged from its sharded model.

(One launch proves both: the layout holds FSDP2's and TP's sharding at once, and resuming
trained weights at lr=0 makes the two exports comparable tensor for tensor.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.run_layout import read_metrics
from eval.export import export_checkpoint
from eval.heldout import load_windows

pytestmark = pytest.mark.slow


def _heldout_loss(hf, pieces, num_tokens) -> float:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for piece in pieces:
            x = torch.tensor([piece])
            logprobs = model(x).logits.log_softmax(-1)[0, :-1]
            total -= logprobs.gather(1, x[0, 1:, None]).sum().item()
    return total / num_tokens


def _val_loss(run: Path, step: int) -> float:
    rows, _ = read_metrics(run)
    return next(r["val_loss"] for r in rows if r["step"] == step and "val_loss" in r)


def _tensors(hf: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(hf.glob("*.safetensors")):
        out |= load_file(f)
    return out


def test_fsdp_tp_checkpoint_exports_identically_and_reaches_trainer_val_loss(
    shakespeare_data, trained, trained_steps, run_training, tmp_path
):
    run, single_rank_hf = trained
    frozen = ("--optimizer.lr=0",)  # one real step that leaves every weight as it was
    fsdp_tp = ("--parallelism.dp_shard=2", "--parallelism.tp=2", *frozen)
    fsdp_tp += (f"--checkpoint.initial_load_path={run / 'checkpoint' / f'step-{trained_steps}'}",)
    sharded_run = run_training(shakespeare_data, tmp_path / "fsdp_tp", 1, extra=fsdp_tp, nproc=4)
    ckpt = sharded_run / "checkpoint" / "step-1"
    assert len(list(ckpt.glob("*.distcp"))) == 4  # really saved by every rank
    hf = export_checkpoint(ckpt, tmp_path / "hf", max_shard_size="1MB")
    assert len(list(hf.glob("model-*.safetensors"))) > 1

    want, got = _tensors(single_rank_hf), _tensors(hf)
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different
    assert all(t.abs().max() > 0 for t in want.values())  # real weights, not zeros

    trainer_loss = _val_loss(sharded_run, 1)
    # validation.steps=2 batches of local_batch_size=4 per rank, 2 data-parallel ranks (the
    # 2 TP ranks of each share its batch).
    windows = load_windows(shakespeare_data / "val", 256, 2 * 4 * 2, seed=1234)
    assert trainer_loss < math.log(2048) - 0.5  # trained: far from the uniform loss
    loss = _heldout_loss(hf, windows.pieces, windows.num_scored_tokens)
    # Measured 3e-4 (FSDP2, step 6): bf16 export vs the trainer's FP8 forward.
    assert abs(loss - trainer_loss) < 0.02, (loss, trainer_loss)
