"""The model: a torchtitan llama3 `ModelSpec` built from our `[model]` and `[fp8]` tables.

Why not torchtitan's flavor names ("8B", "debugmodel"): a flavor hides the shape in Python,
and export/serving need the shape as data. `build_model_spec(run)` builds
`Llama3Model.Config` from the explicit fields (the same way torchtitan's own flavors are
built in `torchtitan/models/llama3/__init__.py`), so the TOML is the single truth and
`RUN/config.toml` describes the checkpoint completely.

Q, K and V are three parameters (`fuse_qkv=False`), not torchtitan's default fused `wqkv`:
the fused module's state-dict hook gathers `wqkv` to full size on every rank to split it,
and torchtitan's checkpointer keeps that state dict for the whole run (25 GiB of fp32 Q/K/V
per GPU at 70B on 32 GPUs; issue 18). Unfused, the state dict only views each rank's
shards. The cost is two more, smaller GEMMs per layer (and under FP8 each has its own
scale); TP shards each colwise as it did `wqkv`. Checkpoints are unchanged for the model
(the fused hook saved `wq`/`wk`/`wv` too); the optimizer state of older, fused checkpoints
is split on load (`train.components.checkpoint`).

What lives elsewhere: FP8 conversion and the FP8 all-gather in `train.fp8`, the CPU
attention in `train.attention`, every "auto" choice in `train.build` (this module asks no
device question: it is given the attention kernel and the FP8 format); parallelism is applied by
torchtitan's `parallelize_llama`.
"""

from __future__ import annotations

import dataclasses

from train.config import RunConfig


def build_model_config(run: RunConfig, attention: str = "sdpa"):
    """`Llama3Model.Config` for `run.model` (no FP8 conversion).

    `attention` is the kernel, already chosen: "flex", "varlen" or "sdpa" (the trainer
    passes `train.build.resolve_attention`'s answer for its device). The default,
    DocumentMaskedSDPA, runs forward and backward on every device, which is all export
    and evaluation need: the weights do not depend on the kernel."""
    import torchtitan.models.llama3 as l3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    from train.attention import document_sdpa_model_cls, use_document_sdpa

    assert attention in ("flex", "varlen", "sdpa"), f"unresolved attention {attention!r}"
    m = run.model
    # sdpa is refused by torchtitan's LM attention factory (plain SDPA cannot see document
    # boundaries); build flex and swap in DocumentMaskedSDPA, which applies flex's own
    # document mask through SDPA (train/attention.py).
    layers = l3._build_llama3_layers(
        fuse_qkv=False,  # see the module docstring
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
    model = document_sdpa_model_cls() if attention == "sdpa" else l3.Llama3Model
    config = model.Config(
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
        use_document_sdpa(config)
    return config


def build_model_spec(run: RunConfig, attention: str = "sdpa", fp8_format: str = "fn"):
    """The torchtitan `ModelSpec` (llama3 parallelize/pipeline/state-dict adapter) for `run`;
    `attention` as in `build_model_config`, `fp8_format` the FP8 encoding already chosen
    for the device (`train.build.resolve_fp8_format`; the weights, all export and
    evaluation read, do not depend on it). The state-dict adapter (what a Hugging Face
    folder is loaded through) is llama3's with a Q/K permutation that is right on any
    sharding (`train.components.hf_import.shard_safe_llama3_adapter`)."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.protocols.model_spec import ModelSpec

    from train.components.hf_import import shard_safe_llama3_adapter
    from train.fp8 import fp8_converter_config, parallelize_llama_fp8

    config = build_model_config(run, attention)
    if run.fp8.enable:
        config = fp8_converter_config(run, fp8_format).build().convert(config)
    m = run.model
    return ModelSpec(
        name="llama3",
        flavor=f"d{m.dim}_l{m.n_layers}_h{m.n_heads}_kv{m.n_kv_heads}_v{m.vocab_size}",
        model=config,
        parallelize_fn=parallelize_llama_fp8,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=shard_safe_llama3_adapter(),
    )
