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
Parallelism is applied later, by torchtitan's `parallelize_llama`, apart from the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from train.config import RunConfig


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


def build_model_config(run: RunConfig):
    """`Llama3Model.Config` for `run.model` (no FP8 conversion)."""
    import torchtitan.models.llama3 as l3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    from train import cpu_compat

    m = run.model
    attention = cpu_compat.resolve_attention(m.attention)
    # sdpa is refused by torchtitan's LM attention factory (it cannot use per-document
    # positions); build flex and swap the inner attention afterwards (see cpu_compat #6).
    layers = l3._build_llama3_layers(
        fuse_qkv=True,
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
        from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

        for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def build_model_spec(run: RunConfig):
    """The torchtitan `ModelSpec` (llama3 parallelize/pipeline/state-dict adapter) for `run`."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import Llama3StateDictAdapter, parallelize_llama
    from torchtitan.protocols.model_spec import ModelSpec

    config = build_model_config(run)
    if run.fp8.enable:
        from train import cpu_compat

        cpu_compat.apply()  # the converter's SM89 check (cpu_compat #5); no-op on GPU
        config = fp8_converter_config(run).build().convert(config)
    m = run.model
    return ModelSpec(
        name="llama3",
        flavor=f"d{m.dim}_l{m.n_layers}_h{m.n_heads}_kv{m.n_kv_heads}_v{m.vocab_size}",
        model=config,
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=Llama3StateDictAdapter,
    )
