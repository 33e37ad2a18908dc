"""vLLM's paged KV cache and the calls its Triton attention backend makes, for one layer.

What `TritonAttentionImpl.forward/do_kv_cache_update` (vllm/v1/attention/backends/
triton_attn.py, vLLM 0.32) do around the kernels: the KV cache in vLLM's layout
[blocks, kv_heads, block_size, 2 * head_dim] seen through `.transpose(1, 2).split()`, block
size 16, a shuffled block table, slots from it, and vLLM's 2D (prefill, mixed batches) or
3D (small decode batches: split softmax plus `reduce_segments`) choice. Used by
tests/eval/test_triton_attention.py (the kernels under Triton's interpreter on CPU) and by
the GPU check's `vllm` part (the same kernels compiled on the GPU).
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 16
NUM_SEGMENTS = 16  # vllm/v1/attention/backends/triton_attn.py NUM_PAR_SOFTMAX_SEGMENTS
MIN_LAUNCH_GRID_SIZE_2D = 128  # same file: decode batches below 128 // kv_heads go 3D


class PagedAttention:
    """One attention layer's paged KV cache and the calls TritonAttentionImpl makes."""

    def __init__(self, kernels, seq_lens, num_kv_heads, head_dim, dtype, seed=0, device="cpu"):
        self.unified_attention, self.reshape_and_cache = kernels
        self.device = torch.device(device)
        blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks the table never names
        self.kv_cache = torch.zeros(
            num_blocks, num_kv_heads, BLOCK_SIZE, 2 * head_dim, dtype=dtype, device=device
        )
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
        used = 0
        for i, n in enumerate(blocks_per_seq):
            self.block_table[i, :n] = order[used : used + n]
            used += n
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.cached = [0] * len(seq_lens)  # tokens already in the cache, per sequence

    def caches(self):
        # TritonAttentionImpl: "(B, H, N, 2*hs) -> ((B, N, H, hs), (B, N, H, hs))"
        return self.kv_cache.transpose(1, 2).split(self.head_dim, dim=-1)

    def __call__(self, q, k, v, query_lens, scale):
        """q [tokens, heads, d], k/v [tokens, kv_heads, d] for `query_lens[i]` new tokens of
        every sequence i, packed in order; returns attention over each whole sequence."""
        key_cache, value_cache = self.caches()
        slots, seq_lens = [], []
        for i, n in enumerate(query_lens):
            pos = torch.arange(self.cached[i], self.cached[i] + n)
            block = self.block_table[i, pos // BLOCK_SIZE].long()
            slots.append(block * BLOCK_SIZE + pos % BLOCK_SIZE)
            self.cached[i] += n
            seq_lens.append(self.cached[i])
        dev = self.device
        one = torch.ones((), dtype=torch.float32, device=dev)
        self.reshape_and_cache(
            k, v, key_cache, value_cache, torch.cat(slots).to(dev), "auto", one, one
        )
        num_seqs = len(query_lens)
        cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        out = torch.empty_like(q)
        threshold = MIN_LAUNCH_GRID_SIZE_2D // self.num_kv_heads
        segm = (threshold, q.shape[1], NUM_SEGMENTS)
        self.unified_attention(
            q=q,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=cu.to(dev),
            max_seqlen_q=max(query_lens),
            seqused_k=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_seqlen_k=max(seq_lens),
            softmax_scale=scale,
            causal=True,
            window_size=(-1, -1),
            block_table=self.block_table.to(dev),
            softcap=0,
            q_descale=None,
            k_descale=one.expand(num_seqs, self.num_kv_heads),
            v_descale=one.expand(num_seqs, self.num_kv_heads),
            seq_threshold_3D=threshold,
            num_par_softmax_segments=NUM_SEGMENTS,
            softmax_segm_output=torch.empty(*segm, self.head_dim, dtype=torch.float32, device=dev),
            softmax_segm_max=torch.empty(segm, dtype=torch.float32, device=dev),
            softmax_segm_expsum=torch.empty(segm, dtype=torch.float32, device=dev),
        )
        return out


def causal_sdpa(q, k, v, scale):
    """Causal GQA attention in fp32 over one whole sequence: [tokens, heads, d]."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
