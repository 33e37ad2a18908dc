"""Held-out windows and their per-position loss, without a server: the windows the loader
yields for the session's Shakespeare val split, and the bucketing of scored tokens by the
position that predicts them (tests/eval/test_serve_eval.py runs them through vLLM)."""

from __future__ import annotations

import asyncio

import pytest

from eval.heldout import heldout_loss, load_windows, position_buckets


def test_windows_score_every_label_and_fit_the_served_context(shakespeare_data):
    val, seq_len, num_windows = shakespeare_data / "val", 64, 6
    full = load_windows(val, seq_len, num_windows, seed=0)
    # Every input position of every window predicts one label, document cuts or not.
    assert full.num_windows == num_windows
    assert full.num_scored_tokens == num_windows * seq_len
    assert sum(len(p) - 1 for p in full.pieces) == full.num_scored_tokens
    assert max(len(p) for p in full.pieces) == seq_len + 1  # a window within one document
    # Served at max_model_len = seq_len: a piece of the whole window (seq_len + 1 tokens
    # with its last label) cannot be sent, so that label is left out and counted.
    capped = load_windows(val, seq_len, num_windows, seed=0, max_prompt_len=seq_len)
    assert max(len(p) for p in capped.pieces) == seq_len
    num_whole = sum(len(p) == seq_len + 1 for p in full.pieces)
    assert capped.num_unscored_last_labels == num_whole > 0
    assert capped.num_scored_tokens == num_windows * seq_len - num_whole
    assert [p[: len(c)] for p, c in zip(full.pieces, capped.pieces, strict=True)] == capped.pieces


def test_window_longer_than_the_block_is_still_cut(shakespeare_data):
    """An eval length above the run's block_tokens (a window never crosses a block) still
    gets windows: the block is raised to the length."""
    windows = load_windows(shakespeare_data / "val", 96, 2, seed=0, block_tokens=64)
    assert windows.num_scored_tokens == 2 * 96


class _PositionLogprobs:
    """A server whose log-probability of the token at index j is -j: the NLL of a scored
    token names the position that predicted it plus one."""

    async def complete(self, prompt, **_):
        return {"choices": [{"logprobs": {"token_logprobs": [None, *range(-1, -len(prompt), -1)]}}]}


def test_loss_by_position_quarter():
    from eval.heldout import HeldoutWindows

    seq_len = 8
    # one whole window (8 inputs + label) and a window cut by a document start after 3
    pieces = [list(range(9)), list(range(4)), list(range(6))]
    windows = HeldoutWindows(pieces, num_windows=2, num_scored_tokens=16, seq_len=seq_len)
    result = asyncio.run(heldout_loss(_PositionLogprobs(), windows))
    assert position_buckets(seq_len) == [[0, 2], [2, 4], [4, 6], [6, 8]]
    by_position = result["by_position"]
    # positions 0..7, 0..2, 0..4 predict NLLs 1..8, 1..3, 1..5
    assert [b["num_tokens"] for b in by_position] == [6, 5, 3, 2]
    assert [b["loss"] for b in by_position] == pytest.approx(
        [(1 + 2) * 3 / 6, (3 + 4 + 3 + 4 + 3) / 5, (5 + 6 + 5) / 3, (7 + 8) / 2]
    )
    assert result["loss"] == pytest.approx((36 + 6 + 15) / 16)
    assert result["num_tokens"] == 16 and result["num_prompts"] == 3


def test_length_above_served_context_names_the_flag_and_the_fix():
    from eval.runner import check_seq_lens

    check_seq_lens([256, 2048], max_model_len=2048, exported=2048)  # up to the limit is fine
    with pytest.raises(
        ValueError,
        match=r"^--heldout-seq-len 4096 exceeds the served model's "
        r"max_model_len 2048 \(the export's config.json",
    ):
        check_seq_lens([256, 4096], max_model_len=2048, exported=2048)
    # served shorter than the export (--max-model-len): the fix is to serve the whole export
    with pytest.raises(ValueError, match=r"the export allows 8192: serve it without --max-model"):
        check_seq_lens([4096], max_model_len=2048, exported=8192)
    with pytest.raises(ValueError, match=r"2048 \(the server's /v1/models\); pass lengths up"):
        check_seq_lens([4096], max_model_len=2048, exported=None)
