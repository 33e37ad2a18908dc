"""Warm start from a Hugging Face Llama folder (`checkpoint.initial_load_path`;
train/components/hf_import.py, the flag in train/build.py, torchtitan's own HF loader).

The model is made here by transformers, never fetched: a small Llama (64 wide, 2 layers,
4 query heads sharing 2 KV heads, Llama 3.1 RoPE scaling) on the session's Shakespeare
vocabulary, trained for a few dozen steps so its loss is far below a random model's, saved
in bf16 as several safetensors shards with an index. Two runs use it:

- the trainer's own model (built by `to_trainer_config(...).build()`, fp32, no FP8, on CPU,
  FSDP over 4 ranks) loads it through the trainer's checkpointer, and its logits equal
  transformers' to 1e-4;
- `python -m train`'s main on the same 4 ranks, FSDP 2 x TP 2 with the 70B FP8 recipe
  (tensorwise, FP8 all-gather), one step at lr 0: its first loss is the loaded model's, not a random one's,
  its validation loss is transformers' on the same windows, and the checkpoint it saves
  exports (eval/export.py) to the very tensors of the original folder.

A config.json that does not fit the TOML is one line per mismatch, exit 2, no traceback,
through `python -m train`, its `--check` and scripts/train_local.sh.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils.runs import (
    REPO,
    cli,
    read_metrics,
    run_config,
    train_env,
    write_config,
)
from tests.utils.tiny_model import TINY_TRAIN_MODEL_4_HEADS
from train.components.hf_import import check_initial_load, hf_config_mismatches, is_hf_folder
from train.config import load_config

# The TOML's [model] of the small Llama, and the same shape in transformers' names. Its 2
# KV heads are sharded finer than a head on 4 ranks (FSDP 4, and FSDP 2 x TP 2), as
# Llama 3's 8 KV heads are on 16 or more: the cases torchtitan 0.3.0's HF load failed on,
# loudly and silently (train/components/hf_import.py `_permute_whole_heads`).
SHAPE = TINY_TRAIN_MODEL_4_HEADS
HF_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
}
MAX_POSITIONS = 2048  # configs/debug.toml's model.max_seq_len
# Llama 3.1's RoPE scaling (factor 8 over 8192 positions) as eval.export writes it for a
# model of 2048 positions: original, low and high halved three times (same frequencies)
ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 0.125,
    "high_freq_factor": 0.5,
    "original_max_position_embeddings": 1024,
    "rope_theta": 500000.0,
}
SEQ_LEN = 128
INITIAL_LOAD_LOG = "--checkpoint.initial_load_path"  # torchtitan's log line names the flag

# Meta's published config.json of Llama 3.1 8B and 70B (meta-llama/Llama-3.1-8B, -70B)
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
LLAMA31_70B = LLAMA31_8B | {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}
# Llama 3 8B (before 3.1): no RoPE scaling, 8192 positions
LLAMA3_8B = LLAMA31_8B | {"rope_scaling": None, "max_position_embeddings": 8192}


def _hf_folder(path: Path, config: dict) -> Path:
    """A folder the check takes for an HF model (the check reads no weights)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    return path


# --------------------------------------------------------------------------- the check


@pytest.mark.parametrize(
    ("config", "hf"),
    [("llama3_8b_fp8", LLAMA31_8B), ("llama3_70b_fp8", LLAMA31_70B)],
)
def test_published_llama31_folders_fit_the_shipped_configs(config, hf):
    run = load_config(REPO / "configs" / f"{config}.toml")
    assert hf_config_mismatches(run, hf) == []


def test_llama3_8b_before_31_names_both_keys_to_change():
    run = load_config(REPO / "configs" / "llama3_8b_fp8.toml")
    lines = hf_config_mismatches(run, LLAMA3_8B)
    assert len(lines) == 2, lines
    assert lines[0].startswith('model.rope_scaling = true but rope_type = "default"')
    assert lines[0].endswith("set model.rope_scaling = false")
    assert lines[1].startswith("model.max_seq_len = 131072 but max_position_embeddings = 8192")


@pytest.mark.parametrize("config", ["debug", "llama3_1b"])
def test_the_exporters_config_json_fits_its_own_config(config):
    """eval.export's config.json (halved RoPE fields for a short model, weight tying for
    the 1B) is accepted for the config it was written from: the check is the export's
    inverse, as the weights are."""
    from eval.export import ExportSource, hf_config
    from train.model import build_model_config

    run = load_config(REPO / "configs" / f"{config}.toml")
    source = ExportSource(build_model_config(run), Path(), run.model.max_seq_len)
    with pytest.MonkeyPatch.context() as patch:  # no tokenizer needed for the shape
        patch.setattr("eval.export.special_token_ids", lambda _: (0, 1))
        hf = hf_config(source)
    assert hf_config_mismatches(run, hf) == []
    # a model of another shape is caught on the same dict
    other = load_config(REPO / "configs" / f"{config}.toml", [("model.n_kv_heads", 1)])
    assert [line.split(" but ")[0] for line in hf_config_mismatches(other, hf)] == [
        "model.n_kv_heads = 1"
    ]


def test_the_model_spec_names_the_shard_safe_adapter(tmp_path):
    """The trainer loads an HF folder through the model spec's adapter, which torchtitan's
    Trainer builds from the spec and the checkpointer keeps as given: ours, whose Q/K
    permutation on an unsharded weight is torchtitan's own."""
    import torch
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    from train.components.checkpoint import RunCheckpointManager
    from train.components.hf_import import shard_safe_llama3_adapter
    from train.model import build_model_spec

    run = load_config(REPO / "configs" / "debug.toml")
    spec = build_model_spec(run)
    assert spec.state_dict_adapter is shard_safe_llama3_adapter()
    assert issubclass(spec.state_dict_adapter, Llama3StateDictAdapter)
    ours, theirs = (
        spec.state_dict_adapter(spec.model, None),
        Llama3StateDictAdapter(spec.model, None),
    )
    config = RunCheckpointManager.Config(enable=True, async_mode="disabled", keep_latest_k=0)
    parts = {"dataloader": None, "model_parts": [], "optimizers": None, "lr_schedulers": None}
    checkpointer = RunCheckpointManager(
        config, **parts, states={}, sd_adapter=theirs, base_folder=str(tmp_path)
    )
    assert checkpointer.sd_adapter is theirs  # the spec decides; nothing is swapped
    w = torch.arange(256 * 8, dtype=torch.float32).reshape(256, 8)
    for name in ("_permute", "_reverse_permute"):
        assert torch.equal(getattr(ours, name)(w, 8), getattr(theirs, name)(w, 8)), name


def test_llama31_rope_constants_are_torchtitans():
    """model.rope_scaling = true selects torchtitan's RoPE.Config defaults; the check
    compares config.json with copies of them (it imports no torch)."""
    from torchtitan.models.common.rope import RoPE

    from train.components import hf_import

    defaults = RoPE.Config(dim=64, max_seq_len=128)
    assert (
        defaults.scaling_factor,
        defaults.low_freq_factor,
        defaults.high_freq_factor,
        defaults.original_max_position_embeddings,
    ) == (
        hf_import.LLAMA3_ROPE_FACTOR,
        hf_import.LLAMA3_LOW_FREQ_FACTOR,
        hf_import.LLAMA3_HIGH_FREQ_FACTOR,
        hf_import.LLAMA3_ORIGINAL_MAX_POSITIONS,
    )


def test_folders_that_are_neither_checkpoint_nor_model_are_refused(run_toml, tmp_path):
    from train.build import to_trainer_config
    from train.config import ConfigError

    def run_with(path: Path):
        return load_config(run_toml(checkpoint={"initial_load_path": str(path)}))

    hf = _hf_folder(tmp_path / "hf", LLAMA31_8B | HF_SHAPE | {"vocab_size": 2048})
    dcp = tmp_path / "step-5"
    dcp.mkdir()
    assert is_hf_folder(hf) and not is_hf_folder(dcp)
    with pytest.raises(ConfigError, match="neither a complete checkpoint"):
        check_initial_load(run_with(dcp))  # a torn save: no .metadata, no config.json
    (dcp / ".metadata").write_bytes(b"")
    (dcp / "config.json").write_text("{}")  # a checkpoint beside a config is a checkpoint
    assert not is_hf_folder(dcp)
    check_initial_load(run_with(dcp))
    # the flag torchtitan reads, and the absolute path it requires
    assert not to_trainer_config(run_with(dcp)).checkpoint.initial_load_in_hf
    mapped = to_trainer_config(run_with(Path("relative") / ".." / hf)).checkpoint
    assert mapped.initial_load_in_hf and mapped.initial_load_path == str(hf.resolve())
    with pytest.raises(ConfigError, match="no such folder"):
        check_initial_load(run_with(tmp_path / "missing"))
    # a download that stopped: the index names a shard that is not there
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-2.safetensors"}})
    )
    with pytest.raises(ConfigError, match="1 shard.*missing.*model-2.safetensors"):
        check_initial_load(run_with(hf))
    (hf / "model-2.safetensors").write_bytes(b"")
    (hf / "model-3.safetensors").write_bytes(b"")  # left by an older download
    with pytest.raises(ConfigError, match="1 .*not named by.*model-3.safetensors"):
        check_initial_load(run_with(hf))
    (hf / "model-3.safetensors").unlink()
    (hf / "model-2.safetensors").unlink()
    (hf / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no \*.safetensors"):
        check_initial_load(run_with(hf))


def test_a_resume_does_not_check_the_folder_it_ignores(run_toml, tmp_path):
    """Once RUN holds a complete checkpoint, initial_load_path is not loaded: a run that
    resumes must not fail on a Hugging Face folder that was moved or no longer fits."""
    from train.config import ConfigError

    hf = _hf_folder(tmp_path / "llama31_8b", LLAMA31_8B)  # debug-sized TOML: mismatches
    run = load_config(run_toml(checkpoint={"initial_load_path": str(hf)}))
    with pytest.raises(ConfigError):
        check_initial_load(run)
    step = run.run_dir / "checkpoint" / "step-4"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    check_initial_load(run)


@pytest.mark.parametrize("entry", ["python -m train", "--check", "train_local.sh", "submit.py"])
def test_mismatching_folder_is_one_line_per_mismatch(run_toml, tmp_path, entry):
    """The debug-sized TOML against Llama 3.1 8B's config.json: six shape keys differ."""
    hf = _hf_folder(tmp_path / "llama31_8b", LLAMA31_8B)
    config = run_toml(checkpoint={"initial_load_path": str(hf)})
    launchers = {
        "train_local.sh": [str(REPO / "scripts" / "train_local.sh"), str(config)],
        "submit.py": [sys.executable, str(REPO / "scripts" / "slurm" / "submit.py")]
        + ["--gpus-per-node", "0", "--nproc-per-node", "2", "--time", "10:00", str(config)],
    }
    if entry in launchers:
        proc = subprocess.run(
            launchers[entry],
            cwd=REPO,
            env=train_env() | {"NPROC": "2"},
            capture_output=True,
            text=True,
            timeout=120,
        )
    else:
        proc = cli("--config", str(config), *(["--check"] if entry == "--check" else []))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "torchrun" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 6, proc.stderr
    expected = [
        ("model.dim = 256", "hidden_size = 4096", "set model.dim = 4096"),
        ("model.n_layers = 4", "num_hidden_layers = 32", "set model.n_layers = 32"),
        ("model.n_heads = 8", "num_attention_heads = 32", "set model.n_heads = 32"),
        ("model.n_kv_heads = 4", "num_key_value_heads = 8", "set model.n_kv_heads = 8"),
        ("model.ffn_hidden_dim = 768", "intermediate_size = 14336", "model.ffn_hidden_dim = 14336"),
        ("model.vocab_size = 2048", "vocab_size = 128256", "set model.vocab_size = 128256"),
    ]
    for line, fragments in zip(lines, expected, strict=True):
        assert str(hf) in line, line
        for fragment in fragments:
            assert fragment in line, (fragment, line)


# --------------------------------------------------------------------------- the load


@pytest.fixture(scope="module")
def hf_llama(shakespeare_data, tmp_path_factory) -> Path:
    """A small Llama made and briefly trained by transformers on the Shakespeare train
    split, saved in bf16 (so that an fp32 trainer's export gives the same bits back), in
    3 safetensors shards with model.safetensors.index.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **HF_SHAPE,
        vocab_size=2048,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_parameters=ROPE,
        tie_word_embeddings=False,
        initializer_range=0.1,  # large weights: a Q/K permutation mistake shows in the logits
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, (batch, labels) in enumerate(_batches(shakespeare_data / "train", 8)):
        logits = model(input_ids=batch["input"]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 30:
            break
    out = tmp_path_factory.mktemp("hf_llama") / "llama"
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="300KB")
    assert len(list(out.glob("model-*.safetensors"))) >= 2
    return out


def _batches(split: Path, batch_size: int, seed: int = 7):
    """(inputs, labels) batches of SEQ_LEN-token windows of a prepared split."""
    from dataloader.loader import MixEntry, TokenShardDataLoader

    loader = TokenShardDataLoader.Config(
        mix=[MixEntry(path=str(split))], seed=seed, infinite=False
    ).build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=None,
        seq_len=SEQ_LEN,
        local_batch_size=batch_size,
        snapshot_every_n_steps=None,
    )
    return loader


def _hf_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def _warm_start_ranks(rank, world_size, fp32_config: str, fp8_config: str, out: str) -> None:
    """Each of 4 spawned ranks: (1) the trainer's fp32 model (FSDP over all 4), built
    and loaded as `python -m train` builds and loads it, its logits before the load (its
    random init) and after; (2) then `python -m train`'s own main() on the FP8 config.
    One set of processes for both: a torchrun would pay the imports again."""
    import os

    import torch

    from train.runtime import prepare_runtime

    prepare_runtime()
    from torchtitan.tools.logging import init_logger

    from train.__main__ import main
    from train.build import to_trainer_config

    init_logger()
    tokens = torch.load(Path(out) / "tokens.pt")
    trainer = to_trainer_config(load_config(fp32_config)).build()
    try:
        # the state dict a save stages, with the trainer's own dataloader, LR schedule and
        # step counter: as many tensors as the host preflight counts from the config
        from tests.utils.checkpointer import staged_states
        from train.preflight import staged_state_dict

        staged = torch.utils._pytree.tree_leaves(staged_states(trainer.checkpointer))
        degrees = {"dp_replicate": 1, "dp_shard": world_size, "tp": 1, "cp": 1}
        predicted = staged_state_dict(load_config(fp32_config), degrees)
        assert sum(isinstance(v, torch.Tensor) for v in staged) == predicted.tensors

        model = trainer.model_parts[0]

        def logits():
            # the trainer's loss (ChunkedLossWrapper) applies lm_head itself, chunk by
            # chunk, so the model's forward may stop at the final norm
            hidden = model(tokens)
            return model.lm_head(hidden) if hidden.shape[-1] == SHAPE["dim"] else hidden

        with torch.no_grad():
            random_init = logits()
            assert trainer.checkpointer.load(), "nothing loaded"  # Trainer.train()'s first call
            imported = logits()
    finally:
        trainer.close()
    torch.distributed.destroy_process_group()
    if rank == 0:
        torch.save({"random_init": random_init, "imported": imported}, Path(out) / "logits.pt")
    os.environ["MASTER_PORT"] = (Path(out) / "port").read_text()  # a fresh rendezvous
    assert main(["--config", fp8_config]) == 0


def _loss(logits, tokens) -> float:
    import torch

    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()
    ).item()


@pytest.mark.slow
def test_hf_llama_warm_starts_the_trainer(hf_llama, shakespeare_data, tmp_path, capfd):
    import torch
    from transformers import LlamaForCausalLM

    from common.io import free_port
    from eval.export import export_checkpoint
    from eval.heldout import load_windows
    from tests.utils.distributed import run_distributed_test

    reference = LlamaForCausalLM.from_pretrained(hf_llama, dtype=torch.float32).eval()
    batch, _ = next(iter(_batches(shakespeare_data / "val", 2, seed=99)))
    tokens = batch["input"]  # plain causal attention over the window, as transformers'
    out = tmp_path / "out"
    out.mkdir()
    torch.save(tokens, out / "tokens.pt")
    (out / "port").write_text(str(free_port()))
    # (a) fp32, no FP8, FSDP on 4 ranks: only loading the weights
    fp32 = run_config(
        shakespeare_data,
        tmp_path / "fp32",
        model=SHAPE,
        fp8={"enable": False},
        validation={"enable": False},
        checkpoint={"initial_load_path": str(hf_llama)},
    )
    # (b) + (d) FSDP 2 x TP 2 with the 70B FP8 recipe, one step at lr 0 (a real optimizer
    # step that leaves every weight as it was), validating at step 1
    fp8 = run_config(
        shakespeare_data,
        tmp_path / "fp8",
        model=SHAPE,
        fp8={"enable": True, "recipe": "tensorwise", "fsdp_float8_all_gather": True},
        training={"steps": 1, "local_batch_size": 2, "global_batch_size": -1},
        parallelism={"dp_shard": 2, "tp": 2},
        optimizer={"lr": 0.0},
        validation={"freq": 1, "steps": 2},
        # a synchronous save: the async daemon (a fresh interpreter per rank) would cost
        # seconds of imports and has nothing to do with where the weights came from
        checkpoint={"initial_load_path": str(hf_llama), "interval": 1, "async_mode": "disabled"},
        # the hang watchdog is a client of torchrun's store, which these ranks lack
        fault_tolerance={"hang_timeout_s": 0},
    )
    run = load_config(write_config(tmp_path / "fp8.toml", fp8))
    run_distributed_test(
        _warm_start_ranks,
        4,
        str(write_config(tmp_path / "fp32.toml", fp32)),
        str(tmp_path / "fp8.toml"),
        str(out),
        init=False,
    )
    console = "".join(capfd.readouterr())  # the ranks write to this process's stdout/stderr
    # every rank of the first trainer logs it, rank 0 of `python -m train` (quiet console)
    assert console.count(f"Loading from HF safetensors from {INITIAL_LOAD_LOG}: {hf_llama}") == 5
    assert "FSDP float8 all-gather on for 14 weights" in console

    # (a) the imported model's logits are transformers'
    got = torch.load(out / "logits.pt")
    with torch.no_grad():
        want = reference(tokens).logits
    diff = (got["imported"] - want).abs().max().item()
    print(f"max |logits - transformers| = {diff:.2e} (logits up to {want.abs().max():.1f})")
    assert diff < 1e-4
    random_loss = _loss(got["random_init"], tokens)
    assert _loss(want, tokens) < random_loss - 1.0  # the folder holds a trained model

    (first,) = read_metrics(run.run_dir, "train")
    (val,) = read_metrics(run.run_dir, "val")
    # (d) training started from the loaded weights: its first loss is the trained model's,
    # not a random init's, and on the validation windows it is transformers' own loss
    print(f"first-step loss {first['loss']:.3f} (FP8), random init {random_loss:.3f}")
    assert first["loss"] < random_loss - 1.0
    val_windows = load_windows(
        shakespeare_data / "val", SEQ_LEN, 2 * 2 * 2, seed=run.dataloader.seed
    )
    total, num_tokens = 0.0, 0
    with torch.no_grad():
        for piece in val_windows.pieces:
            x = torch.tensor([piece])
            logprobs = reference(x).logits.log_softmax(-1)[0, :-1]
            total -= logprobs.gather(1, x[0, 1:, None]).sum().item()
            num_tokens += len(piece) - 1
    hf_val = total / num_tokens
    print(f"val loss {val['val_loss']:.4f} (trainer, FP8) vs {hf_val:.4f} (transformers, fp32)")
    assert abs(val["val_loss"] - hf_val) < 0.05

    # (b) the checkpoint exports to the original folder's tensors, bit for bit
    exported = export_checkpoint(run.run_dir / "checkpoint" / "step-1", tmp_path / "export")
    want_tensors, got_tensors = _hf_tensors(hf_llama), _hf_tensors(exported)
    assert sorted(got_tensors) == sorted(want_tensors)
    different = [k for k in want_tensors if not torch.equal(got_tensors[k], want_tensors[k])]
    assert not different, different
