#!/usr/bin/env python
"""Generation throughput: vLLM server vs transformers `generate`, same prompts, same machine.

Why: the eval pipeline serves checkpoints with vLLM rather than generating in-process with
transformers; this measures what that buys on the current machine. Both decode greedily a
fixed number of new tokens (EOS ignored) for the same prompts (the shipped task prompts);
vLLM gets all requests at once (it batches them), transformers gets one left-padded batch.

    .venv/bin/python scripts/bench_eval.py HF_DIR [--num-prompts 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import timed, versions  # noqa: E402

from eval.client import CompletionClient  # noqa: E402
from eval.serve import VLLMServer  # noqa: E402
from eval.tasks import builtin_task_files, load_tasks  # noqa: E402


def prompts(num: int, bos: str) -> list[str]:
    tasks = [t for f in builtin_task_files() for t in load_tasks(f)]
    return [bos + t.prompt for t in tasks[:num]]


async def vllm_generate(url: str, texts: list[str], max_tokens: int) -> tuple[float, int]:
    async with CompletionClient(url, concurrency=len(texts)) as client:
        await client.connect(30)
        # One warm-up request: the first request pays one-off costs.
        await client.complete(prompt=texts[0], max_tokens=2, temperature=0.0)
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(
                client.complete(prompt=t, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                for t in texts
            )
        )
        seconds = time.perf_counter() - t0
    return seconds, sum(o["usage"]["completion_tokens"] for o in outs)


def hf_generate(hf_dir: Path, texts: list[str], max_tokens: int) -> tuple[float, int]:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.pad_token, tok.padding_side = tok.eos_token, "left"
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def generate(inputs: dict, new: int):
        config = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
        return model.generate(**inputs, **config, pad_token_id=tok.pad_token_id)

    with torch.no_grad():
        generate({k: v[:1] for k, v in batch.items()}, 2)  # warm-up: one-off costs
        out, seconds = timed(generate, batch, max_tokens)
    return seconds, (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("hf_dir", type=Path)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    bos = json.loads((args.hf_dir / "tokenizer_config.json").read_text()).get("bos_token", "")
    texts = prompts(args.num_prompts, bos)
    t_start = time.perf_counter()
    with VLLMServer(args.hf_dir, max_model_len=1024) as server:
        startup_s = time.perf_counter() - t_start
        v_s, v_tokens = asyncio.run(vllm_generate(server.url, texts, args.max_tokens))
        backend = server.attention_backend
    h_s, h_tokens = hf_generate(args.hf_dir, texts, args.max_tokens)
    import torch

    result = {
        "prompts": len(texts),
        "new_tokens_per_prompt": args.max_tokens,
        "vllm": {
            "seconds": v_s,
            "tokens": v_tokens,
            "tokens_per_s": v_tokens / v_s,
            "server_startup_s": startup_s,
            "attention_backend": backend,
        },
        "transformers": {"seconds": h_s, "tokens": h_tokens, "tokens_per_s": h_tokens / h_s},
        "ratio_vllm_over_transformers": (v_tokens / v_s) / (h_tokens / h_s),
        "versions": versions(("vllm", "transformers", "torch")),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
    }
    print(json.dumps(result, indent=2))
    print(
        f"vLLM {result['vllm']['tokens_per_s']:.1f} tok/s vs transformers "
        f"{result['transformers']['tokens_per_s']:.1f} tok/s: "
        f"ratio {result['ratio_vllm_over_transformers']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
