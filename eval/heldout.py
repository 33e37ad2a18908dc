"""Held-out loss through the server: to catch a broken export, and to see long context work.

Why: the trainer logs a validation loss from its own model; the served model must reach
the same loss on the same tokens, or the export (RoPE permutation, norms, tying, dtype)
or the serving config is wrong. We replay the trainer's validation windows from the
prepared val shards with the project's own loader, send them as token-id prompts with
`echo=True, logprobs=1, max_tokens=0`, and average the prompt-token log-probabilities.

Windows are cut at document starts (where the loader's positions restart at 0) and each
piece is its own prompt, so vLLM sees the same RoPE positions as training did, and the
trainer's attention stops at document boundaries on every device (train/attention.py on
CPU). What still differs: the server computes in bf16; hence a tolerance, not equality.

The same replay at another length L (`python -m eval --heldout-seq-len`) is the held-out
loss at L: windows of L consecutive tokens of the val stream, positions restarting at
document starts, every one of the L labels of a window scored, so a window's tokens are
scored with up to L tokens of their own document as context. Its loss is also reported
per quarter of the positions ([0, L/4), ..., [3L/4, L)): after a long-context stage the
late quarters are where the loss should fall (docs/eval.md).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.asyncio import tqdm_asyncio

from eval.client import CompletionClient

NUM_POSITION_BUCKETS = 4  # quarters of the window: where in a window the loss falls


@dataclass
class HeldoutWindows:
    pieces: list[list[int]]  # token-id prompts; every token after the first is scored
    num_windows: int
    num_scored_tokens: int
    seq_len: int
    # A window of seq_len tokens is one prompt of seq_len + 1 (its inputs and the label
    # of its last position); where that exceeds the served max_model_len, the last label
    # of such a piece is left out and counted here.
    num_unscored_last_labels: int = 0


def load_windows(
    val_dir: Path | str,
    seq_len: int,
    num_windows: int,
    seed: int,
    block_tokens: int | None = None,
    shuffle_blocks: int | None = None,
    max_prompt_len: int | None = None,
) -> HeldoutWindows:
    """The first `num_windows` sequences the loader yields for `val_dir` (as validation,
    with the run's `block_tokens` / `shuffle_blocks`: the loader's defaults when None;
    raised to seq_len where a block would be shorter than one window). Pieces are at most
    `max_prompt_len` tokens (the server's max_model_len)."""
    from dataloader.loader import MixEntry, TokenShardDataLoader

    config = TokenShardDataLoader.Config(
        mix=[MixEntry(path=str(val_dir))], seed=seed, infinite=False
    )
    config.block_tokens = max(block_tokens or config.block_tokens, seq_len)
    config.shuffle_blocks = shuffle_blocks or config.shuffle_blocks
    loader = config.build(seq_len=seq_len, local_batch_size=1)  # one rank
    batches = list(itertools.islice(loader, num_windows))
    if not batches:
        raise ValueError(f"{val_dir}: held-out split yields no window of {seq_len + 1} tokens")
    pieces, num_unscored = [], 0
    for batch, labels in batches:
        inputs = batch["input"][0].tolist()
        positions = batch["positions"][0].numpy()
        labels = labels[0].tolist()
        starts = [0] + [int(i) for i in np.flatnonzero(positions[1:] == 0) + 1] + [len(inputs)]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            piece = inputs[a:b] + [labels[b - 1]]
            if max_prompt_len is not None and len(piece) > max_prompt_len:
                assert len(piece) == max_prompt_len + 1, (len(piece), max_prompt_len)
                piece = piece[:-1]
                num_unscored += 1
            pieces.append(piece)
    num_scored = sum(len(piece) - 1 for piece in pieces)
    return HeldoutWindows(pieces, len(batches), num_scored, seq_len, num_unscored)


def position_buckets(seq_len: int, num_buckets: int = NUM_POSITION_BUCKETS) -> list[list[int]]:
    """[start, end) position ranges splitting [0, seq_len) into `num_buckets` near-equal parts."""
    edges = [seq_len * i // num_buckets for i in range(num_buckets + 1)]
    return [[a, b] for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


async def heldout_loss(client: CompletionClient, windows: HeldoutWindows) -> dict:
    """Mean NLL over the scored tokens, and per position bucket: the token at index j of a
    piece is predicted at position j - 1 (positions restart at 0 with each piece)."""
    started = time.perf_counter()
    buckets = position_buckets(windows.seq_len)
    bucket_of = np.searchsorted([b for _, b in buckets], np.arange(windows.seq_len), side="right")
    sums, counts = np.zeros(len(buckets)), np.zeros(len(buckets), dtype=np.int64)

    async def score(piece: list[int]) -> None:
        out = await client.complete(
            prompt=piece, max_tokens=0, echo=True, logprobs=1, temperature=0.0
        )
        logprobs = out["choices"][0]["logprobs"]["token_logprobs"]
        assert len(logprobs) == len(piece), (len(logprobs), len(piece))
        where = bucket_of[: len(piece) - 1]
        np.add.at(sums, where, -np.asarray(logprobs[1:], dtype=np.float64))
        np.add.at(counts, where, 1)

    await tqdm_asyncio.gather(
        *map(score, windows.pieces), desc=f"held-out loss @{windows.seq_len}", unit="prompt"
    )
    assert int(counts.sum()) == windows.num_scored_tokens, (counts, windows.num_scored_tokens)
    loss = float(sums.sum()) / windows.num_scored_tokens
    return {
        "seq_len": windows.seq_len,
        "loss": loss,
        "perplexity": math.exp(loss),
        "num_windows": windows.num_windows,
        "num_prompts": len(windows.pieces),
        "num_tokens": windows.num_scored_tokens,
        "num_unscored_last_labels": windows.num_unscored_last_labels,
        "by_position": [
            {"positions": bucket, "loss": float(s / n) if n else None, "num_tokens": int(n)}
            for bucket, s, n in zip(buckets, sums, counts, strict=True)
        ],
        "seconds": time.perf_counter() - started,
    }
