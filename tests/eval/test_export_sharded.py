"""Export from checkpoints saved by sharded layouts (real 2-rank gloo runs): FSDP2 and TP.

The check does not trust the exporter's own reader: the exported model, run in-process by
transformers on the trainer's validation windows, must reach the `val_loss` the trainer
logged from its sharded model at that step."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eval.export import export_checkpoint
from eval.heldout import load_windows

pytestmark = pytest.mark.slow
NUM_STEPS = 20  # far enough from the uniform loss ln(2048)=7.62 for the check to bite


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


@pytest.mark.parametrize(
    "layout",
    [("--parallelism.dp_shard=2",), ("--parallelism.dp_shard=1", "--parallelism.tp=2")],
    ids=["fsdp2", "tp2"],
)
def test_sharded_checkpoint_export_reaches_trainer_val_loss(
    shakespeare_data, run_training, tmp_path, layout
):
    run = run_training(shakespeare_data, tmp_path / "run", NUM_STEPS, extra=layout, nproc=2)
    ckpt = run / "checkpoint" / f"step-{NUM_STEPS}"
    assert len(list(ckpt.glob("*.distcp"))) == 2  # one shard file per rank
    hf = export_checkpoint(ckpt, tmp_path / "hf")

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trainer_loss = next(r["val_loss"] for r in rows if r["step"] == NUM_STEPS and "val_loss" in r)
    # validation.steps=2 batches of local_batch_size=4 per rank, 2 data-parallel ranks under
    # FSDP, 1 under TP (both TP ranks see the same batch).
    num_dp = 2 if "--parallelism.dp_shard=2" in layout else 1
    windows = load_windows(shakespeare_data / "val", 256, 2 * 4 * num_dp, seed=1234)
    assert trainer_loss < math.log(2048) - 0.5
    loss = _heldout_loss(hf, windows.pieces, windows.num_scored_tokens)
    # Measured 3e-4 (FSDP2, step 6): bf16 export vs the trainer's FP8 forward.
    assert abs(loss - trainer_loss) < 0.02, (loss, trainer_loss)
