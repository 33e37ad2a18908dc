"""Attention on CPU: torchtitan's FlexAttention mask, applied through SDPA.

Why: the loader packs several documents into each training sequence, and torchtitan's
trainer builds a FlexAttention `BlockMask` from the batch's `positions` so that a token
attends only to earlier tokens of its own document. FlexAttention has no backward on CPU
in torch 2.13, and plain causal SDPA would let tokens attend across document boundaries
(different maths from a GPU run). `DocumentMaskedSDPA` keeps FlexAttention's config and
mask, and evaluates that mask densely for SDPA, which has a CPU backward: the same
attention on every device (tested equal in tests/train/test_attention.py).

How: `train.build.resolve_attention` picks "sdpa" where FlexAttention has no backward;
`use_document_sdpa(model_config)` then swaps every FlexAttention config of the model for
this subclass. Being a FlexAttention, it also takes torchtitan's FlexAttention context
parallelism as it is (K/V all-gathered before `forward`, the mask sharded on its query
rows). Built lazily: importing torchtitan is slow.

The mask, eagerly: torchtitan builds every FlexAttention `BlockMask` with a torch.compile'd
`create_block_mask`, whose block tables only FlexAttention's kernel reads. This attention
reads the mask's `mask_mod` and shape alone, so a model of it (`document_sdpa_model_cls`)
builds the same mask with torch's plain `create_block_mask`: no dynamo trace and no
inductor build in each process's first step (5-20 s of a CPU launch's start).

Which SDPA kernel: eager, torch's own choice. Compiled, `sdpa_backends_under_compile`
picks per device type, one function for every device: flash or memory-efficient attention
where the partitioner handles RNG ops graph-safely (CUDA: `model.attention = "sdpa"` on a
GPU), the math kernel where it does not (the CPU; a torch 2.13 bug under compile + TP +
activation checkpointing, docs/upstream/compile_tp_ac.md). Masked GQA attention gets K and
V expanded to the query's heads first, as the memory-efficient kernel (the one that takes
a mask) has no GQA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend


@functools.cache
def document_sdpa_cls():
    """`DocumentMaskedSDPA`, built lazily (importing torchtitan is slow)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    from torchtitan.models.common.attention import FlexAttention

    class DocumentMaskedSDPA(FlexAttention):
        """SDPA with torchtitan's own FlexAttention mask, made dense.

        torchtitan's trainer builds the causal + packed-document `BlockMask` from the
        batch's `positions` for any FlexAttention config (so for this subclass too);
        here its `mask_mod` is evaluated on the full (q, kv) grid and handed to SDPA as a
        boolean mask. Same attention as FlexAttention, with a backward on CPU
        (FlexAttention has none there in torch 2.13); it costs an L x L mask per sequence
        and layer, fine at CPU sizes.
        """

        @dataclass(kw_only=True, slots=True)
        class Config(FlexAttention.Config):
            pass

        def forward(
            self,
            q_BLNH,
            k_BLNH,
            v_BLNH,
            *,
            attention_masks,
            score_mod=None,
            scale=None,
            enable_gqa=False,
            out_transform=None,
            **kwargs,
        ):
            assert score_mod is None and out_transform is None, "plain attention only"
            # no mask (a forward outside the trainer, e.g. export parity): one causal sequence
            mask = None if attention_masks is None else dense_mask(attention_masks, q_BLNH.device)
            q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
            if mask is not None and enable_gqa and k.shape[1] != q.shape[1]:
                # torch's fused kernels take a mask (memory-efficient) or GQA (flash), not
                # both: give K and V the query's heads, as the math kernel does inside (on
                # CPU the same bits and time: 42 ms fwd + bwd at B4 H8/KV4 L256 D32 either
                # way), so that a GPU can run the memory-efficient kernel
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
                enable_gqa = False
            kwargs = dict(
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa
            )
            if not torch.compiler.is_compiling():
                out_BNLH = F.scaled_dot_product_attention(q, k, v, **kwargs)
            else:
                with sdpa_kernel(sdpa_backends_under_compile(q.device.type)):
                    out_BNLH = F.scaled_dot_product_attention(q, k, v, **kwargs)
            return out_BNLH.transpose(1, 2)

    return DocumentMaskedSDPA


@functools.cache
def document_sdpa_model_cls():
    """torchtitan's `Llama3Model` whose document mask is built eagerly (the essay's last
    paragraph), built lazily like `DocumentMaskedSDPA`."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask
    from torchtitan.models.llama3 import Llama3Model

    class DocumentMaskedLlama3(Llama3Model):
        @dataclass(kw_only=True, slots=True)
        class Config(Llama3Model.Config):
            pass

        def _create_flex_attention_mask(self, positions, attn_config, mask_mods):
            batch, seq_len = positions.shape
            block = attn_config.inner_attention.block_size
            return create_block_mask(
                and_masks(*mask_mods), batch, None, seq_len, seq_len, positions.device, block
            )

    return DocumentMaskedLlama3


def dense_mask(block_mask, device):
    """The BlockMask's own mask_mod on the whole (batch, 1, q, kv) grid: broadcast index
    tensors over (q, kv) and one `torch.vmap` over the batch rows (what torch's
    `create_mask` computes with four nested vmaps, which torch.compile could not trace
    under activation checkpointing; this compiles whole, tests/train/test_attention.py).
    The vmap hands the mask_mod `b` as the scalar FlexAttention's kernel gives it: torch's
    CP mask_mod under the "ptrr" balancer looks up the row's rearrangement as
    `indices[b][i]`, which a broadcast (batch, 1, 1, 1) index misreads.

    Under context parallelism the grid is this rank's queries x the whole sequence:
    torchtitan's `cp_shard` replaces the mask by torch's `_create_cp_block_mask`, of
    shape (batch, 1, q_len / cp, kv_len), whose mask_mod maps a local query index and
    an index into the all-gathered (load-balanced) K/V back to global positions before
    asking the document mask (tests/train/test_context_parallel.py, which also checks it
    against the block tables FlexAttention's GPU kernel reads)."""
    batch, _, q_len, kv_len = block_mask.shape
    h = torch.zeros((), dtype=torch.long, device=device)
    q_idx = torch.arange(q_len, device=device).view(q_len, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, kv_len)
    rows = torch.vmap(lambda b: block_mask.mask_mod(b, h, q_idx, kv_idx))
    return rows(torch.arange(batch, device=device)).unsqueeze(1)


def sdpa_backends_under_compile(device_type: str):
    """The SDPA kernels `DocumentMaskedSDPA` may use when compiled on `device_type`.

    Policy: the fused kernels, flash (the unmasked causal path, GQA included) and
    memory-efficient (the document mask), never the math kernel, which materialises the
    L x L scores in the compiled graph. Eager runs keep torch's own choice.

    Workaround: the math kernel alone where AOT autograd cannot save a recomputed RNG op's
    state as a graph input (`rng_is_graph_safe` false: the CPU). Every SDPA overload but the
    decomposed math one is tagged `nondeterministic_seeded`; under activation checkpointing
    the partitioner then appends its RNG state to the forward outputs after a saved TP
    DeviceMesh, breaking the saved-values layout ("expected all tensors_saved_with_vc_check
    to be Tensors ... DeviceMesh"; docs/upstream/compile_tp_ac.md). The math kernel
    decomposes into matmul/softmax (no dropout at p=0): no RNG op. Retire when torch's
    `functionalize_rng_ops` inserts RNG states before the saved opaque objects as well as
    before the symints (the fix proposed in that doc): then the fused kernels everywhere.
    """
    if not rng_is_graph_safe(device_type):
        return [SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


@torch.compiler.assume_constant_result
def rng_is_graph_safe(device_type: str) -> bool:
    """Whether torch 2.13's partitioner keeps a recomputed RNG op's state on `device_type`
    as a graph input (graph-safe) rather than a forward output: its own condition in
    `functionalize_rng_ops` (torch/_functorch/partitioners.py), for one device. CUDA by
    default; the CPU never. Called inside compiled blocks, where dynamo may not trace
    torch's `_functorch` helpers: it runs once at trace time and its answer is a constant
    of the graph."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._functorch._aot_autograd.utils import supports_graphsafe_rng

    return (
        functorch_config.graphsafe_rng_functionalization
        and not inductor_config.fallback_random
        and supports_graphsafe_rng(torch.device(device_type))
    )


def use_document_sdpa(model_config) -> None:
    """Swap every FlexAttention of `model_config` for `DocumentMaskedSDPA` (same mask)."""
    from torchtitan.models.common.attention import FlexAttention

    sdpa = document_sdpa_cls()
    for _, _, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        setattr(parent, attr, sdpa.Config())
