"""DCP checkpoint -> Hugging Face Llama folder that transformers and vLLM load as-is.

Why a separate exporter instead of torchtitan's `last_save_in_hf`: torchtitan writes only
the weights (no `config.json`, no tokenizer), leaves a `sharded/` folder beside them and
writes *into the run's checkpoint folder*, after which its own resume logic treats the HF
folder as the newest checkpoint and fails on the missing `.metadata`. This exporter only
reads the checkpoint, and writes a complete folder elsewhere.

How, streaming, so a 70B checkpoint exports on an ordinary node:
1. The model shape comes from the run's torchtitan model config (`RUN/config.toml`, two
   levels above `RUN/checkpoint/step-N`). Building that model on the meta device gives the
   exact parameter names and shapes; DCP's `.metadata` is checked against them before any
   tensor is read, and the HF names and the shard layout are planned from it.
2. Shard by shard (at most `--max-shard-size` of bf16, default 5GB), DCP reads a bounded
   group of model tensors (~1 GiB as stored; never the optimizer) into plain CPU tensors
   with no process group. DCP reads any subset of keys and reshards on load, so any
   FSDP/TP layout the run was saved with works.
3. Each tensor is cast to bf16 and passed through torchtitan's llama3 `state_dict_adapter`
   (`to_hf`), which renames it and applies the RoPE Q/K permutation (torchtitan rotates
   interleaved pairs, HF rotates halves). The shard is written with safetensors (from the
   tensors' own memory) and freed. Peak memory: one shard + one group + a fixed overhead,
   whatever the model size (docs/bench/export.md).
4. More than one shard gets HF's `model-0000k-of-0000n.safetensors` names and
   `model.safetensors.index.json`; a single one is `model.safetensors`.
5. Everything is written to `OUT.tmp-PID-XXXX`, `config.json` last, and renamed into
   place, so a crash never leaves a folder that looks like a model; the next export
   removes the leftovers of a dead one.
"""

from __future__ import annotations

import datetime as dt
import glob
import json
import math
import os
import pickle
import re
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm import tqdm

from common.io import ArgumentParser, check_folder_writable, run_cli, write_json_atomic
from common.noise import filter_known_noise
from common.process import process_alive
from common.run_layout import CONFIG, is_complete_checkpoint, parse_step_dir
from dataloader.tokenizer import load_special_ids

# Top-level keys torchtitan's CheckpointManager stores beside the flattened model state.
NON_MODEL_PREFIXES = ("optimizer", "dataloader", "lr_scheduler", "train_state")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
EXPORT_INFO = "export_info.json"
INDEX_FILE = "model.safetensors.index.json"
EXPORT_DTYPE = torch.bfloat16
DEFAULT_MAX_SHARD_SIZE = "5GB"
# Bytes (as stored, fp32) read by one dcp.load: enough to keep DCP's per-call planning
# cost small, small beside a shard. A single larger tensor (70B's embedding: 4.2 GB) is
# read alone.
DEFAULT_GROUP_BYTES = 1 << 30
DAMAGED = "damaged checkpoint, a file torn or cut short; export another step"


@dataclass
class ExportSource:
    """What the exporter needs besides the checkpoint itself."""

    model_config: Any  # torchtitan Llama3Model.Config
    tokenizer_dir: Path
    max_position_embeddings: int


def checkpoint_step(checkpoint_dir: Path) -> int:
    """N of a complete checkpoint folder step-N; a ValueError for anything else."""
    step = parse_step_dir(checkpoint_dir.name)
    if step is None:
        raise ValueError(
            f"{checkpoint_dir}: expected a torchtitan checkpoint folder named step-N "
            "(e.g. RUN/checkpoint/step-100)"
        )
    if not checkpoint_dir.is_dir():
        raise ValueError(f"{checkpoint_dir}: no such checkpoint folder")
    if not is_complete_checkpoint(checkpoint_dir, dcp_only=True):
        raise ValueError(
            f"{checkpoint_dir}: incomplete checkpoint (no .metadata; DCP writes it last). "
            "Wait for the save to finish or pick an older step."
        )
    return step


def source_from_run(checkpoint_dir: Path) -> ExportSource:
    """Read `RUN/config.toml` (two levels above step-N) through the train package."""
    from train.config import load_config
    from train.model import build_model_spec

    config_path = checkpoint_dir.resolve().parent.parent / CONFIG
    if not config_path.is_file():
        raise ValueError(
            f"{config_path}: missing; eval.export reads the run's resolved config two levels "
            f"above the checkpoint ({checkpoint_dir}). Pass a folder RUN/checkpoint/step-N."
        )
    run = load_config(config_path)
    # the run's tokenizer: relative paths are from the cwd, as for training
    tokenizer_dir = Path(run.dataloader.tokenizer)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ValueError(
            f"{config_path}: dataloader.tokenizer = {str(tokenizer_dir)!r} has no tokenizer.json "
            "(run eval.export from the folder training ran in, or fix the path)"
        )
    return ExportSource(build_model_spec(run).model, tokenizer_dir, run.model.max_seq_len)


def hf_config(source: ExportSource) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from a torchtitan Llama3Model.Config."""
    c = source.model_config
    attn = c.layers[0].attention
    rope = attn.rope
    max_positions = int(source.max_position_embeddings)
    if rope.scaling == "llama":
        rope_scaling = llama3_rope_parameters(rope, max_positions)
    elif rope.scaling == "none":
        rope_scaling = {"rope_type": "default", "rope_theta": float(rope.theta)}
    else:
        raise ValueError(f"rope scaling {rope.scaling!r} has no Llama export; use none or llama")
    bos_id, eos_id = special_token_ids(source.tokenizer_dir)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.dim,
        "intermediate_size": c.layers[0].feed_forward.w1.out_features,
        "num_hidden_layers": len(c.layers),
        "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads or attn.n_heads,
        "head_dim": attn.head_dim or c.dim // attn.n_heads,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": float(c.norm.eps),
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        # transformers < 5 and vLLM read rope_theta/rope_scaling; transformers 5 reads
        # rope_parameters. Write both so every consumer sees the same RoPE.
        "rope_theta": float(rope.theta),
        "rope_scaling": rope_scaling if rope.scaling == "llama" else None,
        "rope_parameters": rope_scaling,
        "tie_word_embeddings": bool(c.enable_weight_tying),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def llama3_rope_parameters(rope: Any, max_positions: int) -> dict[str, Any]:
    """Llama 3.1 RoPE scaling fields equal to torchtitan's, valid for `max_positions`.

    transformers requires `original_max_position_embeddings < max_position_embeddings`
    (else it warns on every load), but torchtitan's defaults (8192) exceed a short model's
    RoPE range (the debug model's 2048). Llama 3.1's frequencies depend only on the
    wavelength bounds `original / low_freq_factor` and `original / high_freq_factor` and on
    `original / wavelength - low_freq_factor` over `high_freq_factor - low_freq_factor`;
    dividing all three of `original`, `low_freq_factor`, `high_freq_factor` by the same
    power of two leaves every one of them, bit for bit, unchanged. So halve them until
    `original` fits, and keep `max_position_embeddings` = the range the model was built for.
    """
    original = int(rope.original_max_position_embeddings)
    low, high = float(rope.low_freq_factor), float(rope.high_freq_factor)
    while original >= max_positions and original % 2 == 0 and original > 1:
        original, low, high = original // 2, low / 2, high / 2
    if original >= max_positions:
        raise ValueError(
            f"model.max_seq_len={max_positions} is too short for Llama 3.1 RoPE scaling with "
            f"original_max_position_embeddings={rope.original_max_position_embeddings}; "
            "raise model.max_seq_len or set model.rope_scaling = false"
        )
    return {
        "rope_type": "llama3",
        "factor": float(rope.scaling_factor),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
        "rope_theta": float(rope.theta),
    }


def write_tokenizer_files(tokenizer_dir: Path, out: Path, max_positions: int) -> None:
    """The tokenizer files, with tokenizer_config.json's `model_max_length` set to the
    model's context: vLLM serves min(config.json max_position_embeddings, that value) and
    transformers warns past it, so the tokenizer's own value (a base tokenizer's 8192, a
    trained one's default) must not cut a long-context model's served context short."""
    present = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    assert len(present) >= 2, "special_token_ids() already required both tokenizer files"
    for name in present:
        shutil.copy2(tokenizer_dir / name, out / name)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = max_positions
    write_json_atomic(out / "tokenizer_config.json", tok_config)


def special_token_ids(tokenizer_dir: Path) -> tuple[int, int]:
    """(bos_id, eos_id) as `dataloader.prepare` stored them around every document."""
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    return load_special_ids(tokenizer_dir / "tokenizer.json", tok_config)[:2]


@dataclass(frozen=True)
class _Tensor:
    """One exported tensor: where DCP has it and where the HF folder gets it."""

    key: str  # torchtitan name in the checkpoint
    hf_key: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # as stored in the checkpoint (fp32 for a training checkpoint)

    @property
    def source_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def out_bytes(self) -> int:
        return math.prod(self.shape) * EXPORT_DTYPE.itemsize


def parse_size(text: str | int) -> int:
    """`5GB`, `500MB`, `2GiB`, `1000` (bytes) -> bytes; decimal units as in HF's
    `max_shard_size`, binary ones with an `i`."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in units or float(match.group(1)) <= 0:
        raise ValueError(
            f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB or 2GiB"
        )
    return int(float(match.group(1)) * units[unit])


def plan_tensors(checkpoint_dir: Path, metadata: Any, model_config: Any) -> list[_Tensor]:
    """The tensors to export, in the model's order, checked against the run's model config
    (names and shapes) from DCP's metadata alone: no tensor is read yet."""
    with torch.device("meta"):
        expected = model_config.build().state_dict()
    stored = metadata.state_dict_metadata
    model_keys = {k for k in stored if not k.startswith(NON_MODEL_PREFIXES)}
    missing = sorted(set(expected) - model_keys)
    unexpected = sorted(model_keys - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint_dir}: checkpoint does not match the run's model config: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:3]}). Was RUN/config.toml changed after training?"
        )
    adapter = _adapter(model_config)
    plan = []
    for key, meta_tensor in expected.items():
        md = stored[key]
        assert isinstance(md, TensorStorageMetadata), key
        if tuple(md.size) != tuple(meta_tensor.shape):
            raise ValueError(
                f"{checkpoint_dir}: {key} has shape {tuple(md.size)} in the checkpoint but "
                f"{tuple(meta_tensor.shape)} in the run's model config"
            )
        # The adapter on a meta tensor: the HF name, and no name for a tied lm_head.
        hf = adapter.to_hf({key: meta_tensor})
        assert len(hf) <= 1, (key, hf)
        for hf_key in hf:
            plan.append(_Tensor(key, hf_key, tuple(md.size), md.properties.dtype))
    num_tied = 1 if model_config.enable_weight_tying else 0
    assert len(plan) == len(expected) - num_tied, sorted(expected)
    return plan


def _adapter(model_config: Any):
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Llama3StateDictAdapter(model_config, None)


def read_metadata(checkpoint_dir: Path) -> Any:
    """DCP's `.metadata` of `checkpoint_dir`; a torn one (a truncated copy) is a user error."""
    try:
        return dcp.FileSystemReader(str(checkpoint_dir)).read_metadata()
    except (EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"{checkpoint_dir}: {DAMAGED} (.metadata: {e!r})") from None


def _reader(checkpoint_dir: Path, metadata: Any):
    """A FileSystemReader that reuses the metadata already read: a 70B training checkpoint's
    `.metadata` describes every rank's optimizer chunks and is read once, not per group."""

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata

    return _Reader(str(checkpoint_dir))


def read_group(checkpoint_dir: Path, metadata: Any, group: list[_Tensor]) -> dict:
    """Read `group` into full CPU tensors, with no process group: DCP reads only these
    keys and reshards whatever FSDP/TP chunks they were saved as into the full tensors."""
    state = {t.key: torch.empty(t.shape, dtype=t.dtype) for t in group}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=_reader(checkpoint_dir, metadata))
        except dcp.api.CheckpointException as e:  # a torn .distcp: DCP wraps the reader's EOFError
            (error, _), *_ = e.failures.values()
            raise ValueError(f"{checkpoint_dir}: {DAMAGED} ({error!r})") from None
    return state


def load_model_state(checkpoint_dir: Path, model_config: Any) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP checkpoint, full and as stored (torchtitan names), in
    one read: for tests and small models. Exports stream instead (`write_weights`)."""
    metadata = read_metadata(checkpoint_dir)
    plan_tensors(checkpoint_dir, metadata, model_config)  # names and shapes checked
    with torch.device("meta"):
        keys = list(model_config.build().state_dict())
    # every key: plan_tensors skips a tied lm_head (no HF name), read it too
    stored = metadata.state_dict_metadata
    group = [_Tensor(k, k, tuple(stored[k].size), stored[k].properties.dtype) for k in keys]
    return read_group(checkpoint_dir, metadata, group)


def write_weights(
    checkpoint_dir: Path, model_config: Any, out: Path, max_shard_bytes: int, progress: tqdm
) -> dict[str, Any]:
    """Write the bf16 HF weights of `checkpoint_dir` into the folder `out`, one shard at a
    time; returns the index (`metadata.total_size`, `weight_map`).

    Memory: one shard's bf16 tensors (safetensors writes them from their own memory) plus
    one group's tensors as stored, whatever the size of the model."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.torch import save_file

    metadata = read_metadata(checkpoint_dir)
    tensors = {t.hf_key: t for t in plan_tensors(checkpoint_dir, metadata, model_config)}
    # HF's own shard plan and names (`save_pretrained`'s): bf16 bytes per shard, a larger
    # tensor alone, one `model.safetensors` or `model-0000k-of-0000n.safetensors`
    split = split_state_dict_into_shards_factory(
        tensors,
        get_storage_size=lambda t: t.out_bytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_bytes,
    )
    adapter = _adapter(model_config)
    for name, hf_keys in split.filename_to_tensors.items():
        out_tensors: dict[str, torch.Tensor] = {}
        # the shard in groups of DEFAULT_GROUP_BYTES as stored, one dcp.load each: HF's
        # planner again, on the stored bytes
        groups = split_state_dict_into_shards_factory(
            {k: tensors[k] for k in hf_keys},
            get_storage_size=lambda t: t.source_bytes,
            filename_pattern="{suffix}",
            max_shard_size=DEFAULT_GROUP_BYTES,
        ).filename_to_tensors.values()
        for group in ([tensors[k] for k in keys] for keys in groups):
            state = read_group(checkpoint_dir, metadata, group)
            for t in group:
                # bf16 first, then the adapter's RoPE permutation (they commute), so the
                # permuted copy is a bf16 one.
                value = state.pop(t.key).to(EXPORT_DTYPE)
                (hf_key, hf_value), *_ = adapter.to_hf({t.key: value}).items()
                assert hf_key == t.hf_key, (hf_key, t.hf_key)
                out_tensors[hf_key] = hf_value.contiguous()
                del value, hf_value
                progress.update(t.out_bytes)
            del state
        save_file(out_tensors, str(out / name), metadata={"format": "pt"})
        del out_tensors
    return {"metadata": split.metadata, "weight_map": split.tensor_to_filename}


def _check_out_dir(out_dir: Path, checkpoint_dir: Path, force: bool) -> None:
    out_abs, ckpt_abs = out_dir.resolve(), checkpoint_dir.resolve()
    checkpoints_root = ckpt_abs.parent
    if out_abs == checkpoints_root or checkpoints_root in out_abs.parents:
        raise ValueError(
            f"--out {out_dir} is inside the run's checkpoint folder {checkpoints_root}; "
            "torchtitan would then take it for a checkpoint and fail to resume. "
            "Export somewhere else, e.g. RUN/hf/step-N"
        )
    check_folder_writable(out_dir, "--out")  # a file there, or above it
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        info = out_dir / EXPORT_INFO
        what = "files"
        if info.is_file():
            what = f"an export of {json.loads(info.read_text()).get('source_checkpoint')}"
        raise ValueError(f"--out {out_dir} already holds {what}; pass --force to replace it")


def _remove_stale_tmp(out_dir: Path) -> None:
    """Delete `OUT.tmp-PID-*` folders of exports whose process is gone (killed mid-export):
    a 70B one holds 140 GB."""
    for p in out_dir.parent.glob(f"{glob.escape(out_dir.name)}.tmp-*-*"):
        pid = p.name[len(out_dir.name) + len(".tmp-") :].split("-", 1)[0]
        if not pid.isdigit() or process_alive(int(pid), start_ticks=None):
            continue
        print(f"eval.export: removing {p} (left by a killed export)", file=sys.stderr)
        shutil.rmtree(p, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():  # safetensors' own writer does not fsync
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_checkpoint(
    checkpoint_dir: Path | str,
    out_dir: Path | str,
    source: ExportSource | None = None,
    force: bool = False,
    max_shard_size: str | int | None = None,
) -> Path:
    """Export `checkpoint_dir` to a Hugging Face Llama folder `out_dir`; returns it
    (`max_shard_size` None: DEFAULT_MAX_SHARD_SIZE)."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    max_shard_bytes = parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    step = checkpoint_step(checkpoint_dir)
    _check_out_dir(out_dir, checkpoint_dir, force)
    source = source or source_from_run(checkpoint_dir)
    config = hf_config(source)  # validates the tokenizer before the slow part

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
    progress = tqdm(
        desc=f"export step-{step}", unit="B", unit_scale=True, file=sys.stderr, mininterval=2
    )
    try:
        index = write_weights(checkpoint_dir, source.model_config, tmp, max_shard_bytes, progress)
        if len(set(index["weight_map"].values())) > 1:
            write_json_atomic(tmp / INDEX_FILE, index)
        write_json_atomic(
            tmp / "generation_config.json",
            {
                "bos_token_id": config["bos_token_id"],
                "eos_token_id": config["eos_token_id"],
                "do_sample": False,
            },
        )
        write_tokenizer_files(source.tokenizer_dir, tmp, config["max_position_embeddings"])
        write_json_atomic(
            tmp / EXPORT_INFO,
            {
                "source_checkpoint": str(checkpoint_dir.resolve()),
                "step": step,
                "exported_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "num_params": index["metadata"]["total_size"] // EXPORT_DTYPE.itemsize,
                "dtype": "bfloat16",
                "num_shards": len(set(index["weight_map"].values())),
                "trained_max_seq_len": int(source.max_position_embeddings),
                "tokenizer_dir": str(source.tokenizer_dir.resolve()),
            },
        )
        # config.json last: a folder killed before this point is not a model to any loader.
        write_json_atomic(tmp / "config.json", config)
        _fsync_tree(tmp)
        # Swap into place: a replaced (--force) export is moved aside first, so at any
        # moment out_dir is either the old complete export or the new one.
        old = None
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=out_dir.name + ".old-", dir=out_dir.parent))
            os.replace(out_dir, old / "x")
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        progress.close()
    return out_dir


def main(argv: list[str] | None = None) -> int:
    filter_known_noise()  # before torchao is imported: see common/noise.py
    parser = ArgumentParser(prog="python -m eval.export", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="RUN/checkpoint/step-N")
    parser.add_argument("--out", required=True, type=Path, help="folder to write the HF model to")
    parser.add_argument("--force", action="store_true", help="replace an existing export")
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="largest safetensors file, e.g. 5GB (default), 500MB, 2GiB",
    )
    args = vars(parser.parse_args(argv))  # --force and --max-shard-size: keyword arguments
    return run_cli(
        lambda: print(export_checkpoint(args.pop("checkpoint"), args.pop("out"), **args))
    )


if __name__ == "__main__":
    sys.exit(main())
