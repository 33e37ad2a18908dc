"""What one traced training step holds and does on rank 0: the planner's counts.

Why a module of its own: the counts are the contract between the tracer (`train.plan.trace`,
which fills them), the time model (`train.plan.time_model`), the report (`train.plan.report`) and
the published-runs check (`train.plan.calibration`). Each reads these dataclasses and the two
formulas below, never the tracer's machinery.

What they hold: `StepCounts`, the bytes a rank keeps (parameters, gradients, optimizer
state, the checkpointer's state-dict cache by the storage it allocates), the traced memory
peaks, and two `OpCounts`: one micro-batch (`micro`) and what runs once per optimizer step
(`once`: clipping, the optimizer step). A step is `accumulation x micro + once`
(`StepCounts.step`), with torchtitan's own accumulation count. Every count grows linearly
with the number of identical layers, so a trace of 2 and 3 layers extends to the model
(`StepCounts.extend`).

The two formulas are how a GPU kernel counts what the CPU trace cannot see:
`attention_flops`, the FLOPs a causal attention kernel executes (its blocks on and below
the diagonal, FlashAttention's backward recomputing S), and `fp8_cast_bytes`, the bytes
compiled code moves to cast an FP8 linear's operands, as torchao's roofline model has them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3

# FlexAttention's default sparse block (torch.nn.attention.flex_attention
# _DEFAULT_SPARSE_BLOCK_SIZE); FlashAttention's tiles are as large. A causal kernel computes
# the blocks on and below the diagonal.
ATTENTION_BLOCK = 128


def attention_flops(
    batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, backward: bool = False
) -> int:
    """FLOPs a causal attention kernel executes (FlexAttention with its block mask, or
    FlashAttention with is_causal): 2 GEMMs of 2*d per (query, key) pair forward (QK^T,
    PV) and 5 backward (S recomputed, dP, dV, dQ, dK), over the causal blocks only.

    `q_len < kv_len` is context parallelism: this rank's queries (two load-balanced chunks)
    against the gathered keys; it computes 1/cp of the causal blocks of the whole sequence.
    One document per sequence: a packed batch's document mask skips more blocks (the plan
    does not know the documents; this is the bound the published runs, causal SDPA, match).
    """
    blocks = -(-kv_len // ATTENTION_BLOCK)
    causal_pairs = ATTENTION_BLOCK**2 * blocks * (blocks + 1) // 2
    pairs = causal_pairs * q_len // kv_len
    gemms = 5 if backward else 2
    return gemms * 2 * batch * heads * head_dim * pairs


@dataclass
class OpCounts:
    """What one phase of the step does on rank 0; each dict grows linearly with layers.

    flops: "gemm bfloat16", "gemm float8", "attention", ... -> FLOPs executed
    memory_bytes: bytes read + written by ops that are neither GEMMs, attention nor
        collectives (elementwise, norms, casts, copies, the loss, the optimizer's foreach
        ops), eager: torch.compile fuses part of them
    comm: "MESH KIND DTYPE" -> bytes (the gathered buffer of an all-gather, the input of a
        reduce-scatter, the tensor of an all-reduce); comm_calls: the same keys -> calls
    """

    flops: dict[str, int] = field(default_factory=dict)
    memory_bytes: dict[str, int] = field(default_factory=dict)
    comm: dict[str, int] = field(default_factory=dict)
    comm_calls: dict[str, int] = field(default_factory=dict)

    def add(self, table: str, key: str, value: int) -> None:
        counts = getattr(self, table)
        counts[key] = counts.get(key, 0) + int(value)

    def scaled(self, factor: int) -> OpCounts:
        return self._combine(self, lambda mine, _: mine * factor)

    def plus(self, other: OpCounts) -> OpCounts:
        return self._combine(other, lambda mine, theirs: mine + theirs)

    def extend(self, fewer: OpCounts, step: int, more_layers: int) -> OpCounts:
        return self._combine(fewer, lambda mine, theirs: _extend(mine, theirs, step, more_layers))

    def _combine(self, other: OpCounts, value) -> OpCounts:
        """Each table's keys of either, `value(mine, theirs)` (0 where one lacks a key)."""
        out = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = {k: value(mine.get(k, 0), theirs.get(k, 0)) for k in {*mine, *theirs}}
        return OpCounts(**out)


def _extend(a: int, b: int, step: int, more_layers: int) -> int:
    per_layer, rest = divmod(a - b, step)
    assert rest == 0, "identical layers must cost the same"
    return a + more_layers * per_layer


@dataclass
class StepCounts:
    """What one traced training step holds and does on rank 0 (bytes, FLOPs, counts).

    Every int and OpCounts field grows linearly with the number of identical layers, so
    `extend` carries a trace of few layers to the whole model; `accumulation` (micro-batches
    per optimizer step) and `groups` (mesh dimension -> rank 0's group) do not."""

    layers: int
    accumulation: int
    groups: dict[str, list[int]]
    num_params: int
    num_flops_per_token: int  # torchtitan's MFU formula (6N + 12 l h q t)
    num_local_params: int
    num_float8_linears: int
    num_fsdp_modules: int
    num_ac_wrapped_blocks: int
    parameters: int
    gradients: int
    optimizer: int
    # MemTracker peaks: forward + backward + clipping (params, grads, activations, FSDP
    # buffers, temporaries), and the optimizer step (params, states, temporaries; + grads)
    peak_forward_backward: int
    peak_optimizer_step: int
    state_dict_cache: int  # what the checkpointer's cached state dict allocates
    state_dict_refresh: int  # what a save's `ModelWrapper.state_dict()` allocates on top
    host_staging: int  # pinned host copy an async save stages (model + optimizer state)
    micro: OpCounts  # one micro-batch: forward_backward_step
    once: OpCounts  # once per optimizer step: clip_grad_norm_ + optimizer step

    @property
    def step(self) -> OpCounts:
        """One optimizer step: accumulation x micro-batch + once."""
        return self.micro.scaled(self.accumulation).plus(self.once)

    def extend(self, fewer: StepCounts, layers: int) -> StepCounts:
        """count(layers) = count(self) + (layers - self.layers) * per-layer difference."""
        step = self.layers - fewer.layers
        assert step > 0 and layers >= self.layers
        assert (self.accumulation, self.groups) == (fewer.accumulation, fewer.groups)
        more = layers - self.layers
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(fewer, f.name)
            if f.name in ("layers", "accumulation", "groups"):
                continue
            if isinstance(mine, OpCounts):
                values[f.name] = mine.extend(theirs, step, more)
            else:
                values[f.name] = _extend(mine, theirs, step, more)
        return dataclasses.replace(self, layers=layers, **values)


@functools.cache  # asked at every forward FP8 GEMM of a trace, of a few shapes
def fp8_cast_bytes(recipe: str, m: int, k: int, n: int, weight_share: float = 1.0) -> int:
    """Bytes compiled code reads and writes to cast one FP8 linear's operands (input M x K,
    weight K x N, grad_output M x N; forward and backward), from torchao's roofline model
    (`torchao.testing.training.roofline_utils.get_tensor_memory_traffic_ovhd_s`, asked for
    bytes: bandwidth 1 B/s, fully achievable). `weight_share`: the share of the weight this
    rank casts: 1 / the FSDP degree under the FP8 all-gather, where each rank casts its shard
    before the gather (torchtitan's `precompute_float8_dynamic_scale_for_fsdp`) and the
    gathered weight arrives in FP8."""
    from torchao.testing.training.roofline_utils import get_tensor_memory_traffic_ovhd_s

    as_bytes = {"peak_mem_bw_bytes_sec": 1.0, "pct_achievable_mem_bw": 1.0}
    total = 0.0
    for role, (dim0, dim1) in (("input", (m, k)), ("weight", (k, n)), ("grad_output", (m, n))):
        kernels = get_tensor_memory_traffic_ovhd_s(as_bytes, dim0, dim1, role, recipe, None)
        # each kernel is Max(bytes, launch overhead in s): the bytes are the larger
        share = weight_share if role == "weight" else 1.0
        total += share * sum(float(kernel) for kernel in kernels)
    return int(total)
