"""Held-out loss through the server, to catch a broken export.

Why: the trainer logs a validation loss from its own model; the served model must reach
the same loss on the same tokens, or the export (RoPE permutation, norms, tying, dtype)
or the serving config is wrong. We replay the trainer's validation windows from the
prepared val shards with the project's own loader, send them as token-id prompts with
`echo=True, logprobs=1, max_tokens=0`, and average the prompt-token log-probabilities.

Windows are cut at document starts (where the loader's positions restart at 0) and each
piece is its own prompt, so vLLM sees the same RoPE positions as training did, and the
trainer's attention stops at document boundaries on every device (train/attention.py on
CPU). What still differs: the server computes in bf16; hence a tolerance, not equality.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eval.client import CompletionClient


@dataclass
class HeldoutWindows:
    pieces: list[list[int]]  # token-id prompts; every token after the first is scored
    num_windows: int
    num_scored_tokens: int
    seq_len: int


def load_windows(val_dir: Path | str, seq_len: int, num_windows: int, seed: int) -> HeldoutWindows:
    """The first `num_windows` sequences the loader yields for `val_dir` (as validation)."""
    from dataloader.loader import MixEntry, TokenShardDataLoader

    config = TokenShardDataLoader.Config(
        mix=[MixEntry(path=str(val_dir))], seed=seed, infinite=False
    )
    loader = config.build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=None,
        seq_len=seq_len,
        local_batch_size=1,
        snapshot_every_n_steps=None,
    )
    pieces, num_seen, num_scored = [], 0, 0
    for batch, labels in loader:
        inputs = batch["input"][0].tolist()
        positions = batch["positions"][0].numpy()
        labels = labels[0].tolist()
        starts = [0] + [int(i) for i in np.flatnonzero(positions[1:] == 0) + 1] + [len(inputs)]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            pieces.append(inputs[a:b] + [labels[b - 1]])
            num_scored += b - a
        num_seen += 1
        if num_seen == num_windows:
            break
    if num_seen == 0:
        raise ValueError(f"{val_dir}: held-out split yields no window of {seq_len + 1} tokens")
    return HeldoutWindows(pieces, num_seen, num_scored, seq_len)


async def heldout_loss(client: CompletionClient, windows: HeldoutWindows) -> dict:
    async def score(piece: list[int]) -> float:
        out = await client.complete(
            prompt=piece, max_tokens=0, echo=True, logprobs=1, temperature=0.0
        )
        logprobs = out["choices"][0]["logprobs"]["token_logprobs"]
        assert len(logprobs) == len(piece), (len(logprobs), len(piece))
        return -sum(logprobs[1:])

    bar = tqdm(total=len(windows.pieces), desc="held-out loss", unit="prompt")

    async def tracked(piece):
        nll = await score(piece)
        bar.update()
        return nll

    try:
        nlls = await asyncio.gather(*(tracked(p) for p in windows.pieces))
    finally:
        bar.close()
    loss = sum(nlls) / windows.num_scored_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "num_windows": windows.num_windows,
        "num_prompts": len(windows.pieces),
        "num_tokens": windows.num_scored_tokens,
        "seq_len": windows.seq_len,
    }
