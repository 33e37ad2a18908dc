"""CPU attention respects document boundaries exactly as torchtitan's FlexAttention does.

On CPU the model runs `DocumentMaskedSDPA` (FlexAttention has no CPU backward in torch
2.13). The check: a real loader batch of packed short documents, torchtitan's own
`get_attention_masks(positions)` block mask, the same weights; the model with torchtitan's
FlexAttention (forward runs on CPU) and the CPU path give the same logits, and plain causal
SDPA (what CPU training used before) does not. The model has GQA (4 heads, 2 KV heads), so
the masked path's K/V head expansion is part of what is compared. And which SDPA kernels
the compiled path may use on each device type.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.utils.tiny_model import TINY_TRAIN_MODEL_4_HEADS

SEQ_LEN = 128


@pytest.fixture(scope="module")
def short_docs_batch(shakespeare_data, short_docs_data):
    """A (inputs, positions) batch from the real loader over many short documents."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from dataloader import MixEntry, TokenShardDataLoader

    tokenizer_dir = shakespeare_data / "tokenizer"
    loader = TokenShardDataLoader.Config(mix=[MixEntry(str(short_docs_data / "train"))]).build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=HuggingFaceTokenizer(tokenizer_path=str(tokenizer_dir)),
        seq_len=SEQ_LEN,
        local_batch_size=2,
    )
    inputs, _ = next(iter(loader))
    return inputs["input"], inputs["positions"]


def _model(attention: str):
    from train.config import from_dict
    from train.model import build_model_config

    run = from_dict(
        {
            "model": {
                **TINY_TRAIN_MODEL_4_HEADS,
                **{"vocab_size": 2048, "attention": attention},
            },
            "dataloader": {"mix": [{"path": "unused"}]},
            "validation": {"enable": False},
        }
    )
    config = build_model_config(run, attention)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return config, model


def test_cpu_attention_equals_flex_attention_with_document_mask(short_docs_batch):
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    from train.attention import document_sdpa_cls

    tokens, positions = short_docs_batch
    starts = (positions[:, 1:] == 0).sum().item()
    assert starts >= 4, "the batch must pack several documents per sequence"

    config, cpu_model = _model("sdpa")
    inner = [m for m in cpu_model.modules() if isinstance(m, document_sdpa_cls())]
    assert len(inner) == 2  # the CPU path really runs the document-masked SDPA

    def with_inner(inner_config):
        other = copy.deepcopy(config)  # the model keeps its config: one each
        for _, _, parent, attr in list(other.traverse(FlexAttention.Config)):
            setattr(parent, attr, inner_config)
        model = other.build()
        model.load_state_dict(cpu_model.state_dict())
        return model

    flex_model = with_inner(FlexAttention.Config())
    causal_model = with_inner(ScaledDotProductAttention.Config())
    # torchtitan's own mask, built from the batch's positions, as its trainer builds it
    masks = flex_model.get_attention_masks(positions=positions)
    with torch.no_grad():
        cpu_out = cpu_model(tokens, positions=positions, attention_masks=masks)
        flex_out = flex_model(tokens, positions=positions, attention_masks=masks)
        causal_out = causal_model(tokens, positions=positions)
    torch.testing.assert_close(cpu_out, flex_out, rtol=1e-5, atol=1e-5)
    # cross-document attention (the old CPU path) changes every token after a boundary
    assert (causal_out - flex_out).abs().max() > 1e-3

    # and the CPU path has a backward pass
    cpu_model(tokens, positions=positions, attention_masks=masks).sum().backward()
    assert all(p.grad is not None for p in cpu_model.parameters())


def test_compiled_sdpa_runs_fused_kernels_where_rng_is_graph_safe():
    """`model.attention = "sdpa"` under compile: flash / memory-efficient attention on CUDA
    (the function every device calls, given CUDA's device type), the math kernel only where
    torch's partitioner cannot keep an RNG op's state graph-safe (the CPU, or CUDA with
    inductor's fallback_random: torch's own condition; docs/upstream/compile_tp_ac.md)."""
    import torch._inductor.config as inductor_config
    from torch.nn.attention import SDPBackend

    from train.attention import sdpa_backends_under_compile

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    assert sdpa_backends_under_compile("cuda") == fused
    assert sdpa_backends_under_compile("cpu") == [SDPBackend.MATH]
    with inductor_config.patch(fallback_random=True):
        assert sdpa_backends_under_compile("cuda") == [SDPBackend.MATH]


def test_compiled_document_sdpa_is_one_graph_equal_to_eager(short_docs_batch):
    """The CPU attention compiles whole (fullgraph, as torchtitan compiles each block) with
    its per-device kernel choice inside, and computes what eager does."""
    tokens, positions = short_docs_batch
    _, model = _model("sdpa")
    masks = model.get_attention_masks(positions=positions)
    eager = model(tokens, positions=positions, attention_masks=masks)
    eager.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for block in model.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)
    compiled = model(tokens, positions=positions, attention_masks=masks)
    compiled.sum().backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for p, grad in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, grad, rtol=1e-4, atol=1e-5)
