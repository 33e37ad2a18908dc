"""Export from checkpoints saved by sharded layouts (real gloo runs of `python -m train`),
and the export's crash safety.

- FSDP2 (2 ranks): the exported model, run in-process by transformers on the trainer's
  validation windows, must reach the `val_loss` the trainer logged from its sharded model.
- TP=2 (2 ranks) and FSDP2xTP2 (4 ranks): both resume the single-process `trained` run's
  weights at lr=0 and save them in their own layout; all three export to identical HF
  tensors (DCP reshards on load, whatever the layout).
- A SIGKILL mid-export leaves no folder that looks like a model, and the next export
  cleans up after it."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eval.export import export_checkpoint
from eval.heldout import load_windows

pytestmark = pytest.mark.slow
NUM_STEPS = 20  # far enough from the uniform loss ln(2048)=7.62 for the check to bite
REPO = Path(__file__).resolve().parents[2]


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
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r["val_loss"] for r in rows if r["step"] == step and "val_loss" in r)


def _tensors(hf: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(hf.glob("*.safetensors")):
        out |= load_file(f)
    return out


def test_fsdp2_checkpoint_export_reaches_trainer_val_loss(shakespeare_data, run_training, tmp_path):
    layout = ("--parallelism.dp_shard=2",)
    run = run_training(shakespeare_data, tmp_path / "run", NUM_STEPS, extra=layout, nproc=2)
    ckpt = run / "checkpoint" / f"step-{NUM_STEPS}"
    assert len(list(ckpt.glob("*.distcp"))) == 2  # one shard file per rank
    hf = export_checkpoint(ckpt, tmp_path / "hf", max_shard_size="1MB")
    assert len(list(hf.glob("model-*.safetensors"))) > 1

    trainer_loss = _val_loss(run, NUM_STEPS)
    # validation.steps=2 batches of local_batch_size=4 per rank, 2 data-parallel ranks.
    windows = load_windows(shakespeare_data / "val", 256, 2 * 4 * 2, seed=1234)
    assert trainer_loss < math.log(2048) - 0.5
    loss = _heldout_loss(hf, windows.pieces, windows.num_scored_tokens)
    # Measured 3e-4 (FSDP2, step 6): bf16 export vs the trainer's FP8 forward.
    assert abs(loss - trainer_loss) < 0.02, (loss, trainer_loss)


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, ("--parallelism.dp_shard=1", "--parallelism.tp=2")),
        (4, ("--parallelism.dp_shard=2", "--parallelism.tp=2")),
    ],
    ids=["tp2", "fsdp2xtp2"],
)
def test_tp_layouts_export_identically(
    trained, trained_steps, shakespeare_data, run_training, tmp_path, nproc, layout
):
    src_run, src_hf = trained
    start = src_run / "checkpoint" / f"step-{trained_steps}"
    # lr=0: one step that leaves every weight as loaded, then a checkpoint in this layout.
    extra = (*layout, f"--checkpoint.initial_load_path={start}", "--optimizer.lr=0")
    run = run_training(shakespeare_data, tmp_path / "run", 1, extra=extra, nproc=nproc)
    ckpt = run / "checkpoint" / "step-1"
    assert len(list(ckpt.glob("*.distcp"))) == nproc  # really saved by every rank
    hf = export_checkpoint(ckpt, tmp_path / "hf", max_shard_size="1MB")

    want, got = _tensors(src_hf), _tensors(hf)
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different
    # The layout's own forward saw the same model: its validation loss is the 1-process one.
    assert abs(_val_loss(run, 1) - _val_loss(src_run, trained_steps)) < 0.01


def test_kill_mid_export_leaves_no_model(trained, trained_steps, tmp_path):
    src_run, _ = trained
    out = tmp_path / "hf"
    ckpt = src_run / "checkpoint" / f"step-{trained_steps}"
    # 1-byte shards: one file per tensor, so the export is killed between real shards.
    cmd = [sys.executable, "-m", "eval.export", "--checkpoint", str(ckpt), "--out", str(out)]
    cmd += ["--max-shard-size", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("hf.tmp-*/model-*.safetensors")):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL

    assert not out.exists()
    (leftover,) = tmp_path.iterdir()  # the dead export's temp folder, named as such
    assert leftover.name.startswith(f"hf.tmp-{proc.pid}-")
    assert list(leftover.glob("model-*.safetensors"))
    assert not (leftover / "config.json").exists()  # nothing loads it as a model
    with pytest.raises(OSError):
        from transformers import AutoConfig

        AutoConfig.from_pretrained(leftover)

    # The next export succeeds and removes the dead one's folder.
    export_checkpoint(ckpt, out, max_shard_size="1MB")
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
