"""Warm start from a Hugging Face Llama folder: recognise it, and check it against [model].

Why: continuing the pretraining of Llama 3 8B or 70B on one's own data starts from the
weights Meta publishes in Hugging Face format (config.json + sharded safetensors).
`checkpoint.initial_load_path` therefore takes such a folder as well as our own `step-N`
checkpoints.

How the weights are read is torchtitan's, unchanged: `train.build` sets its
`CheckpointManager.Config.initial_load_in_hf` for an HF folder, and the manager then loads
the model state (only the model: a new run starts its optimizer, schedule and data
afresh) through DCP's `HuggingFaceStorageReader`, straight into each rank's own FSDP/TP
shards, renaming and un-permuting with the llama3 state-dict adapter's `from_hf` (HF rotates
the two halves of each head in RoPE, torchtitan interleaved pairs: the adapter's
`_reverse_permute` of `q_proj`/`k_proj` is the exact inverse of the `_permute` that
`eval.export` applies through the same adapter's `to_hf`). The load happens when training
starts, after the model was built with its FP8 linears and parallelised, exactly as a resume
from our own checkpoint; FP8 casts the loaded high-precision weights at every forward.

What this module adds is the check before any process starts: torchtitan would load a
folder of another shape with an assertion about tensor sizes deep inside DCP, and would load
one of the same shapes but another RoPE, norm epsilon or weight tying silently wrong. So
`check_initial_load` (run by `train.preflight`, i.e. `python -m train`, its `--check` and
the launchers) compares config.json with the [model] section and reports every mismatch,
one line each, naming the TOML key, both values and the fix.

And one upstream workaround, the adapter the model spec names
(`shard_safe_llama3_adapter`, in `train.model.build_model_spec`): torchtitan 0.3.0 runs
the adapter's Q/K permutation on the live, sharded weights, which fails or silently loads
wrong rows on some shardings (`_permute_whole_heads` says which); ours runs it on the
gathered weight. Retired by pytorch/torchtitan#4797 (after 0.3.0) for the failure on more
shards than heads; tests/train/components/test_hf_warm_start.py (FSDP 4, and FSDP 2 x TP 2 for the
silent case) says whether a newer torchtitan still needs it.

Standard library only at import: the launchers' preflight imports this module and no
torch; the adapter class is made (importing torchtitan) when the model spec asks for it.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from common.run_layout import CHECKPOINT_DIR, DCP_METADATA, HF_INDEX, list_checkpoints
from train.config import ConfigError, RunConfig

HF_CONFIG = "config.json"
SAFETENSORS_SUFFIX = ".safetensors"

# The Llama 3.1 RoPE scaling `model.rope_scaling = true` selects: torchtitan's
# `RoPE.Config` defaults (tests/train/components/test_hf_warm_start.py holds them equal).
LLAMA3_ROPE_FACTOR = 8.0
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192

# transformers' LlamaConfig defaults, for keys a config.json may leave out
HF_DEFAULT_ROPE_THETA = 10000.0
HF_DEFAULT_RMS_NORM_EPS = 1e-6


class InitialLoadMismatch(ConfigError):
    """An HF folder that does not fit the config: one self-contained line per mismatch.
    `python -m train` prints each of `lines` as an `error:` line; the message joins them
    so that the other printers of `error: {e}` (scripts/slurm/submit.py, common.io's
    `cli_error`) give every line its prefix too."""

    def __init__(self, lines: list[str]):
        self.lines = lines
        super().__init__("\nerror: ".join(lines))


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face model folder: a config.json, and no DCP `.metadata` (which makes a
    folder one of our checkpoints, whatever else it holds)."""
    path = Path(path)
    return (path / HF_CONFIG).is_file() and not (path / DCP_METADATA).is_file()


def check_initial_load(run: RunConfig) -> None:
    """`checkpoint.initial_load_path`, if set, is a complete DCP checkpoint or an HF Llama
    folder whose config.json matches `run.model`; else a ConfigError (InitialLoadMismatch
    with a line per mismatch)."""
    given = run.checkpoint.initial_load_path
    if not given or list_checkpoints(run.run_dir / CHECKPOINT_DIR)[0]:
        return  # nothing to load, or a resume (which ignores initial_load_path)
    key = "checkpoint.initial_load_path"
    folder = Path(given)
    if not folder.is_dir():
        raise ConfigError(
            f"{key} = {given!r}: no such folder; give a checkpoint folder RUN/checkpoint/step-N "
            "or a Hugging Face Llama folder (config.json + *.safetensors)"
        )
    if (folder / DCP_METADATA).is_file():
        return  # one of our checkpoints
    if not is_hf_folder(folder):
        raise ConfigError(
            f"{key} = {given!r} is neither a complete checkpoint (no {DCP_METADATA}: a save "
            f"that did not finish, or not a step-N folder) nor a Hugging Face model folder (no "
            f"{HF_CONFIG}); pick a complete step-N folder or an HF Llama folder"
        )
    _check_weight_files(folder, key)
    try:
        hf = json.loads((folder / HF_CONFIG).read_text())
    except ValueError as e:
        raise ConfigError(f"{key} {folder / HF_CONFIG}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{key} {folder / HF_CONFIG}: expected a JSON object")
    lines = [f"{key} {folder}: {line}" for line in hf_config_mismatches(run, hf)]
    if lines:
        raise InitialLoadMismatch(lines)


def _check_weight_files(folder: Path, key: str) -> None:
    """Safetensors present, and every shard the index names present (a download that
    stopped half-way is refused here, not half-loaded)."""
    files = {p.name for p in folder.glob(f"*{SAFETENSORS_SUFFIX}")}
    if not files:
        raise ConfigError(
            f"{key} {folder}: no *{SAFETENSORS_SUFFIX} weights (only safetensors are read; "
            "convert a .bin/.pth checkpoint with transformers' save_pretrained)"
        )
    index_path = folder / HF_INDEX
    if not index_path.is_file():
        return
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{key} {index_path}: not a safetensors index ({e!r})") from None
    missing = sorted(set(weight_map.values()) - files)
    if missing:
        raise ConfigError(
            f"{key} {folder}: {len(missing)} shard(s) named by {HF_INDEX} are missing "
            f"(e.g. {missing[0]}); the download is incomplete, fetch the folder again"
        )
    # DCP's reader reads every *.safetensors of the folder, index or not: a stray file
    # (a shard of an older download) could hold the same names with other values
    stray = sorted(files - set(weight_map.values()))
    if stray:
        raise ConfigError(
            f"{key} {folder}: {len(stray)} *{SAFETENSORS_SUFFIX} file(s) not named by "
            f"{HF_INDEX} (e.g. {stray[0]}); remove them (every file there is read)"
        )


def _rope(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(rope scaling fields, rope_theta) of a config.json: transformers >= 5 writes
    `rope_parameters`; older ones (and the published Llama 3 folders) `rope_scaling` and a
    top-level `rope_theta`."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta", HF_DEFAULT_ROPE_THETA))
    return rope, float(theta)


def hf_config_mismatches(run: RunConfig, hf: dict[str, Any]) -> list[str]:
    """Every way the HF `config.json` dict `hf` differs from `run.model`, a line each:
    `model.KEY = OURS but HF_KEY = THEIRS in config.json; FIX`."""
    m = run.model
    lines: list[str] = []
    spell = json.dumps  # a value as both TOML and JSON write it: true, "llama3", 1e-05

    def differs(toml_key: str, ours: Any, hf_key: str, theirs: Any, fix: str = "") -> None:
        lines.append(
            f"{toml_key} = {spell(ours)} but {hf_key} = {spell(theirs)} in {HF_CONFIG}; "
            f"{fix or f'set {toml_key} = {spell(theirs)}'}"
        )

    def unsupported(hf_key: str, theirs: Any, why: str) -> None:
        lines.append(f"{hf_key} = {spell(theirs)} in {HF_CONFIG}: {why}")

    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type != "llama" and "LlamaForCausalLM" not in architectures:
        unsupported(
            "model_type", model_type, "not a Llama model; only Llama (LlamaForCausalLM) loads"
        )
        return lines
    n_heads = hf.get("num_attention_heads")
    shape = (
        ("model.dim", m.dim, "hidden_size", hf.get("hidden_size")),
        ("model.n_layers", m.n_layers, "num_hidden_layers", hf.get("num_hidden_layers")),
        ("model.n_heads", m.n_heads, "num_attention_heads", n_heads),
        ("model.n_kv_heads", m.n_kv_heads, "num_key_value_heads",
         hf.get("num_key_value_heads", n_heads)),
        ("model.ffn_hidden_dim", m.ffn_hidden_dim, "intermediate_size",
         hf.get("intermediate_size")),
        ("model.vocab_size", m.vocab_size, "vocab_size", hf.get("vocab_size")),
    )  # fmt: skip
    for toml_key, ours, hf_key, theirs in shape:
        if theirs is None:
            unsupported(hf_key, None, f"missing; every Llama config.json has it ({toml_key})")
        elif ours != theirs:
            differs(toml_key, ours, hf_key, theirs)
    head_dim = hf.get("head_dim")
    hidden = hf.get("hidden_size")
    if head_dim is not None and hidden and n_heads and head_dim != hidden // n_heads:
        unsupported(
            "head_dim",
            head_dim,
            f"differs from hidden_size / num_attention_heads = {hidden // n_heads}; "
            "the model's head_dim is always model.dim / model.n_heads",
        )

    rope, theta = _rope(hf)
    if not math.isclose(m.rope_theta, theta, rel_tol=1e-9):
        differs("model.rope_theta", m.rope_theta, "rope_theta", theta)
    _check_rope_scaling(m.rope_scaling, rope, differs, unsupported)

    eps = float(hf.get("rms_norm_eps", HF_DEFAULT_RMS_NORM_EPS))
    if not math.isclose(m.norm_eps, eps, rel_tol=1e-9):
        differs("model.norm_eps", m.norm_eps, "rms_norm_eps", eps)
    positions = hf.get("max_position_embeddings")
    if positions is not None and m.max_seq_len > positions:
        differs(
            "model.max_seq_len",
            m.max_seq_len,
            "max_position_embeddings",
            positions,
            f"set model.max_seq_len <= {positions} (the RoPE range these weights were "
            "trained for), and training.seq_len within it",
        )
    tie = bool(hf.get("tie_word_embeddings", False))
    if m.weight_tying != tie:
        differs("model.weight_tying", m.weight_tying, "tie_word_embeddings", tie)

    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            unsupported(flag, hf[flag], "the model has no biases; this is not a Llama 3 layout")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        unsupported("hidden_act", act, "the model's feed-forward is SwiGLU (silu)")
    return lines


def _check_rope_scaling(ours: bool, rope: dict[str, Any], differs, unsupported) -> None:
    """HF's rope_type against `model.rope_scaling`. A Llama 3.1 (`llama3`) scaling matches
    torchtitan's when it gives the same frequencies: equal factor and equal wavelength
    bounds original/low_freq_factor and original/high_freq_factor (eval.export halves all
    three of original, low and high to fit a short model, which changes none of them)."""
    rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if rope_type == "default":
        if ours:
            differs(
                "model.rope_scaling", True, "rope_type", "default", "set model.rope_scaling = false"
            )
        return
    if rope_type != "llama3":
        unsupported(
            "rope_type", rope_type, "only default and llama3 RoPE have a model.rope_scaling"
        )
        return
    if not ours:
        differs("model.rope_scaling", False, "rope_type", "llama3", "set model.rope_scaling = true")
        return
    try:
        factor = float(rope["factor"])
        original = float(rope["original_max_position_embeddings"])
        low = original / float(rope["low_freq_factor"])
        high = original / float(rope["high_freq_factor"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        unsupported("rope_scaling", rope, "an incomplete llama3 RoPE scaling")
        return
    want = (
        LLAMA3_ROPE_FACTOR,
        LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_LOW_FREQ_FACTOR,
        LLAMA3_ORIGINAL_MAX_POSITIONS / LLAMA3_HIGH_FREQ_FACTOR,
    )
    if not all(
        math.isclose(a, b, rel_tol=1e-9) for a, b in zip((factor, low, high), want, strict=True)
    ):
        unsupported(
            "rope_scaling",
            {k: rope[k] for k in sorted(rope) if k != "rope_theta"},
            f"model.rope_scaling = true is Llama 3.1's scaling (factor {LLAMA3_ROPE_FACTOR:g}, "
            f"original_max_position_embeddings {LLAMA3_ORIGINAL_MAX_POSITIONS}, low_freq_factor "
            f"{LLAMA3_LOW_FREQ_FACTOR:g}, high_freq_factor {LLAMA3_HIGH_FREQ_FACTOR:g}); other "
            "factors (e.g. Llama 3.2's 32) have no key in [model]",
        )


# --------------------------------------------------------------------------- the adapter
def _permute_whole_heads(permute, w, n_heads_arg, dim1=None, dim2=None):
    """`permute` (the llama3 adapter's Q/K RoPE row permutation, a view that splits the
    rows into heads) on a sharded weight: gathered, permuted, and resharded into the
    weight's own placements, one tensor at a time.

    Why: torchtitan 0.3.0 applies it to the live, sharded DTensors when it loads a Hugging
    Face folder (`to_hf` makes the load's destinations, `from_hf` undoes it), and DTensor's
    view goes wrong two ways. Sharded over more ranks than the weight has heads, it fails
    ("Cannot unflatten unevenly sharded tensor": Llama 3 8B, with 8 KV heads, on 16 or more
    FSDP ranks; fixed upstream the same way, pytorch/torchtitan#4797, after 0.3.0). Worse,
    under FSDP x TP it can succeed with a strided layout (`_StridedShard` of another split
    factor) that DCP's HF reader then fills with the wrong rows, silently (measured:
    k_proj wrong on FSDP 2 x TP 2, 2 KV heads). Resharded into the parameter's own
    placements, the destination is laid out as every DCP load of that parameter is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(w, DTensor) or all(p.is_replicate() for p in w.placements):
        return permute(w, n_heads_arg, dim1, dim2)
    placements = w.placements
    whole = w.redistribute(placements=[Replicate()] * w.device_mesh.ndim)
    return permute(whole, n_heads_arg, dim1, dim2).redistribute(placements=placements)


@functools.cache
def shard_safe_llama3_adapter() -> type:
    """torchtitan's llama3 state-dict adapter class, whose Q/K permutation is right on any
    sharding (`_permute_whole_heads`); everything else, renaming included, is torchtitan's.
    The model spec's `state_dict_adapter` (`train.model.build_model_spec`). Made on first
    call, not at import, so that this module stays importable without torch."""
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    class ShardSafeLlama3StateDictAdapter(Llama3StateDictAdapter):
        def _permute(self, w, n_heads_arg, dim1=None, dim2=None):
            return _permute_whole_heads(super()._permute, w, n_heads_arg, dim1, dim2)

        def _reverse_permute(self, w, n_heads_arg, dim1=None, dim2=None):
            return _permute_whole_heads(super()._reverse_permute, w, n_heads_arg, dim1, dim2)

    return ShardSafeLlama3StateDictAdapter
