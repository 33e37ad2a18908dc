"""The model: a torchtitan llama3 `ModelSpec` built from our `[model]` and `[fp8]` tables.

Why not torchtitan's flavor names ("8B", "debugmodel"): a flavor hides the shape in Python,
and export/serving need the shape as data. `build_model_spec(run)` builds
`Llama3Model.Config` from the explicit fields (the same way torchtitan's own flavors are
built in `torchtitan/models/llama3/__init__.py`), so the TOML is the single truth and
`RUN/config.toml` describes the checkpoint completely.

FP8 is a config-tree conversion done before the model exists: `Fp8LinearConverter` (a thin
subclass of torchtitan's `Float8LinearConverter`) swaps each eligible `Linear.Config` for
torchao's `Float8Linear`. It adds what torchtitan 0.3.0's converter lacks: the `tensorwise`
recipe and FSDP float8 all-gather for it (weights travel as FP8, halving all-gather bytes).

The FP8 all-gather needs more than a config flag. torchao moves a weight in FP8 only when
the parameter is a `WeightWithDynamicFloat8CastTensor` (its `fsdp_pre_all_gather` casts
the local shard to float8 before FSDP gathers it); torchao wraps weights that way in
`Float8Linear.from_float`, but torchtitan builds `Float8Linear` through `__init__`, so its
weights stay plain and FSDP would gather them in bf16/fp32. `parallelize_fn` here
(`parallelize_llama_fp8`) therefore wraps the weights of every Float8Linear configured for
the all-gather, on the meta model, just before torchtitan's `parallelize_llama` applies
TP, AC, compile and FSDP2 (the order torchao's own FSDP2 recipe uses: convert, then
shard). It does so only when FSDP is on: without FSDP there is nothing to gather.

Parallelism is applied by torchtitan's `parallelize_llama`, apart from the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from train.config import RunConfig


def _document_sdpa_cls():
    """`DocumentMaskedSDPA`, built lazily (torchtitan imports torch)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torchtitan.models.common.attention import FlexAttention

    def dense_mask(block_mask, device) -> torch.Tensor:
        """The BlockMask's own mask_mod on the whole (batch, 1, q, kv) grid, by broadcasting
        index tensors (what torch's `create_mask` computes with vmap, which torch.compile
        cannot trace under activation checkpointing; this can)."""
        batch, _, q_len, kv_len = block_mask.shape
        b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
        q_idx = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
        kv_idx = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
        return block_mask.mask_mod(b, h, q_idx, kv_idx)

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
            kwargs = dict(
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa
            )
            if not torch.compiler.is_compiling():
                out_BNLH = F.scaled_dot_product_attention(q, k, v, **kwargs)
            else:
                # Compiled: SDPA's math backend, not its fused CPU kernel. That kernel is
                # tagged `nondeterministic_seeded` (it could do dropout), so under activation
                # checkpointing AOT autograd saves its RNG state for the recompute, and on CPU
                # (no graph-safe RNG) torch 2.13 appends that state after a saved TP
                # DeviceMesh, breaking its saved-values layout ("expected all
                # tensors_saved_with_vc_check to be Tensors ... DeviceMesh";
                # docs/upstream/compile_tp_ac.md). The math backend decomposes into plain
                # matmul/softmax (no dropout at p=0): no RNG op. Eager keeps the fused
                # kernel (~1.5x faster fwd + bwd at debug-model shapes; no partitioner there).
                with sdpa_kernel(SDPBackend.MATH):
                    out_BNLH = F.scaled_dot_product_attention(q, k, v, **kwargs)
            return out_BNLH.transpose(1, 2)

    return DocumentMaskedSDPA


_DOCUMENT_SDPA = None


def document_sdpa_cls():
    global _DOCUMENT_SDPA
    if _DOCUMENT_SDPA is None:
        _DOCUMENT_SDPA = _document_sdpa_cls()
    return _DOCUMENT_SDPA


def _fp8_converter_cls():
    from torchtitan.components.quantization import Float8LinearConverter

    class Fp8LinearConverter(Float8LinearConverter):
        """torchtitan's converter plus the tensorwise recipe and FP8 FSDP all-gather."""

        @dataclass(kw_only=True, slots=True)
        class Config(Float8LinearConverter.Config):
            recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "rowwise"
            fsdp_float8_all_gather: bool = True
            """Only meaningful for tensorwise (torchao supports it for no other recipe)."""

        def __init__(self, config: Config):
            from train import cpu_compat

            # torchtitan refuses devices below SM89; a CPU has real float8 GEMMs
            with cpu_compat.float8_capability_check():
                super().__init__(config)
            if (
                self.enabled
                and not config.emulate
                and config.recipe_name == "tensorwise"
                and config.fsdp_float8_all_gather
            ):
                self.torchao_config = dataclasses.replace(
                    self.torchao_config, enable_fsdp_float8_all_gather=True
                )

    return Fp8LinearConverter


def wrap_fp8_all_gather_weights(model) -> int:
    """Make each Float8Linear configured for the FSDP float8 all-gather hold its weight as
    torchao's `WeightWithDynamicFloat8CastTensor` (what `Float8Linear.from_float` does).
    Call before FSDP shards the model; returns how many weights are wrapped."""
    import torch
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    wrapped = 0
    for module in model.modules():
        if not isinstance(module, Float8Linear):
            continue
        if not module.config.enable_fsdp_float8_all_gather:
            continue
        if isinstance(module.weight, WeightWithDynamicFloat8CastTensor):
            wrapped += 1
            continue
        module.weight = torch.nn.Parameter(
            WeightWithDynamicFloat8CastTensor(
                module.weight,
                module.linear_mm_config,
                module.config.cast_config_weight.target_dtype,
            ),
            requires_grad=module.weight.requires_grad,
        )
        module.register_state_dict_post_hook(_plain_weight_in_state_dict)
        wrapped += 1
    return wrapped


def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """Checkpoints hold the plain high-precision weight, not torchao's wrapper: DCP and
    torchtitan's state-dict cache need real storage, and export/eval read plain tensors.
    The plain tensor shares the parameter's storage, so loading into it loads the weight."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and isinstance(
        value._local_tensor, WeightWithDynamicFloat8CastTensor
    ):
        state_dict[key] = DTensor.from_local(
            value._local_tensor._tensor,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    elif isinstance(value, WeightWithDynamicFloat8CastTensor):
        state_dict[key] = value._tensor


def fp8_all_gather_weights(model) -> list[str]:
    """Names of the Float8Linear modules whose (local) weight FSDP gathers in float8: what
    the model really holds, not what the config asked for."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    names = []
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            weight = module.weight
            local = weight._local_tensor if isinstance(weight, DTensor) else weight
            if isinstance(local, WeightWithDynamicFloat8CastTensor):
                names.append(name)
    return names


def parallelize_llama_fp8(model, *, parallel_dims, **kwargs):
    """torchtitan's `parallelize_llama`, with FP8 all-gather weights wrapped first when
    FSDP is on (see the module docstring)."""
    from torchtitan.models.llama3 import parallelize_llama

    if parallel_dims.fsdp_enabled:
        wrap_fp8_all_gather_weights(model)
    return parallelize_llama(model, parallel_dims=parallel_dims, **kwargs)


def fp8_converter_config(run: RunConfig):
    cls = _fp8_converter_cls()
    filter_fqns = list(run.fp8.filter_fqns)
    if run.fp8.auto_filter_small_kn:
        filter_fqns.append("auto_filter_small_kn")
    return cls.Config(
        recipe_name=run.fp8.recipe,
        filter_fqns=filter_fqns,
        emulate=run.fp8.emulate,
        fsdp_float8_all_gather=run.fp8.fsdp_float8_all_gather,
        model_compile_enabled=run.compile.enable and "model" in run.compile.components,
    )


def build_model_config(run: RunConfig, accelerator: bool | None = None):
    """`Llama3Model.Config` for `run.model` (no FP8 conversion); "auto" attention resolved
    for `accelerator` (default: this machine)."""
    import torchtitan.models.llama3 as l3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    from train import cpu_compat

    m = run.model
    attention = cpu_compat.resolve_attention(m.attention, accelerator)
    # sdpa is refused by torchtitan's LM attention factory (plain SDPA cannot see document
    # boundaries); build flex and swap in DocumentMaskedSDPA, which applies flex's own
    # document mask through SDPA (see cpu_compat #6).
    layers = l3._build_llama3_layers(
        fuse_qkv=False,
        n_layers=m.n_layers,
        dim=m.dim,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        hidden_dim=m.ffn_hidden_dim,
        rope=ComplexRoPE.Config(
            dim=m.head_dim,
            max_seq_len=m.max_seq_len,
            theta=m.rope_theta,
            scaling="llama" if m.rope_scaling else "none",
        ),
        attn_backend="flex" if attention == "sdpa" else attention,
    )
    for layer in layers:
        layer.attention_norm = dataclasses.replace(layer.attention_norm, eps=m.norm_eps)
        layer.ffn_norm = dataclasses.replace(layer.ffn_norm, eps=m.norm_eps)
    config = l3.Llama3Model.Config(
        dim=m.dim,
        vocab_size=m.vocab_size,
        enable_weight_tying=m.weight_tying,
        tok_embeddings=Embedding.Config(
            num_embeddings=m.vocab_size,
            embedding_dim=m.dim,
            param_init=l3._EMBEDDING_SKIP_INIT if m.weight_tying else l3._EMBEDDING_INIT,
        ),
        norm=RMSNorm.Config(normalized_shape=m.dim, eps=m.norm_eps, param_init=l3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=m.dim, out_features=m.vocab_size, param_init=l3._output_linear_init(m.dim)
        ),
        layers=layers,
    )
    if attention == "sdpa":
        from torchtitan.models.common.attention import FlexAttention

        sdpa = document_sdpa_cls()
        for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
            setattr(parent, attr, sdpa.Config())
    return config


def build_model_spec(run: RunConfig, accelerator: bool | None = None):
    """The torchtitan `ModelSpec` (llama3 parallelize/pipeline/state-dict adapter) for `run`;
    `accelerator` as in `build_model_config`."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import Llama3StateDictAdapter
    from torchtitan.protocols.model_spec import ModelSpec

    config = build_model_config(run, accelerator)
    if run.fp8.enable:
        config = fp8_converter_config(run).build().convert(config)
    m = run.model
    return ModelSpec(
        name="llama3",
        flavor=f"d{m.dim}_l{m.n_layers}_h{m.n_heads}_kv{m.n_kv_heads}_v{m.vocab_size}",
        model=config,
        parallelize_fn=parallelize_llama_fp8,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=Llama3StateDictAdapter,
    )
