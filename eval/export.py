"""DCP checkpoint -> Hugging Face Llama folder that transformers and vLLM load as-is.

Why a separate exporter instead of torchtitan's `last_save_in_hf`: torchtitan writes only
the weights (no `config.json`, no tokenizer), leaves a `sharded/` folder beside them and
writes *into the run's checkpoint folder*, after which its own resume logic treats the HF
folder as the newest checkpoint and fails on the missing `.metadata`. This exporter only
reads the checkpoint, and writes a complete folder elsewhere.

How:
1. The model shape comes from the run's torchtitan model config (`RUN/config.toml`, two
   levels above `RUN/checkpoint/step-N`). Building that model on the meta device gives the
   exact parameter names and shapes to read.
2. DCP reads only those tensors (not the optimizer) into plain CPU tensors with no process
   group: DCP reshards on load, so any FSDP/TP layout the run was saved with works.
3. torchtitan's llama3 `state_dict_adapter.to_hf` renames the tensors and applies the
   RoPE Q/K permutation (torchtitan rotates interleaved pairs, HF rotates halves).
4. Everything is written to `OUT.tmp-XXXX` and renamed into place, so a crash never
   leaves a half-written folder that looks like a model.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dataloader.common import parse_step_dir, run_cli, token_content, write_json_atomic

# Top-level keys torchtitan's CheckpointManager stores beside the flattened model state.
NON_MODEL_PREFIXES = ("optimizer", "dataloader", "lr_scheduler", "train_state")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
EXPORT_INFO = "export_info.json"


@dataclass
class ExportSource:
    """What the exporter needs besides the checkpoint itself."""

    model_config: Any  # torchtitan Llama3Model.Config
    tokenizer_dir: Path
    max_position_embeddings: int


def checkpoint_step(checkpoint_dir: Path) -> int:
    step = parse_step_dir(checkpoint_dir.name)
    if step is None:
        raise ValueError(
            f"{checkpoint_dir}: expected a torchtitan checkpoint folder named step-N "
            "(e.g. RUN/checkpoint/step-100)"
        )
    return step


def check_complete(checkpoint_dir: Path) -> None:
    if not checkpoint_dir.is_dir():
        raise ValueError(f"{checkpoint_dir}: no such checkpoint folder")
    if not (checkpoint_dir / ".metadata").is_file():
        raise ValueError(
            f"{checkpoint_dir}: incomplete checkpoint (no .metadata; DCP writes it last). "
            "Wait for the save to finish or pick an older step."
        )


def source_from_run(checkpoint_dir: Path) -> ExportSource:
    """Read `RUN/config.toml` (two levels above step-N) through the train package."""
    from train.config import load_config
    from train.model import build_model_spec

    config_path = checkpoint_dir.resolve().parent.parent / "config.toml"
    if not config_path.is_file():
        raise ValueError(
            f"{config_path}: missing; eval.export reads the run's resolved config two levels "
            f"above the checkpoint ({checkpoint_dir}). Pass a folder RUN/checkpoint/step-N."
        )
    run = load_config(config_path)
    spec = build_model_spec(run)
    return ExportSource(
        model_config=spec.model,
        tokenizer_dir=run_tokenizer_dir(run, config_path),
        max_position_embeddings=run.model.max_seq_len,
    )


def run_tokenizer_dir(run: Any, config_path: Path) -> Path:
    """The run's tokenizer: `[dataloader] tokenizer` (relative paths are from the cwd,
    as for training)."""
    tokenizer_dir = Path(run.dataloader.tokenizer)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ValueError(
            f"{config_path}: dataloader.tokenizer = {str(tokenizer_dir)!r} has no tokenizer.json "
            "(run eval.export from the folder training ran in, or fix the path)"
        )
    return tokenizer_dir


def hf_config(source: ExportSource) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from a torchtitan Llama3Model.Config."""
    c = source.model_config
    attn = c.layers[0].attention
    n_heads = attn.n_heads
    n_kv_heads = attn.n_kv_heads or n_heads
    head_dim = attn.head_dim or c.dim // n_heads
    rope = attn.rope
    if rope.scaling == "llama":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": float(rope.scaling_factor),
            "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": int(rope.original_max_position_embeddings),
            "rope_theta": float(rope.theta),
        }
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
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": float(c.norm.eps),
        "hidden_act": "silu",
        "max_position_embeddings": int(source.max_position_embeddings),
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


def special_token_ids(tokenizer_dir: Path) -> tuple[int, int]:
    from tokenizers import Tokenizer

    config_path = tokenizer_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = []
    for key in ("bos_token", "eos_token"):
        token = token_content(tok_config.get(key))
        token_id = tokenizer.token_to_id(token) if token else None
        if token_id is None:
            raise ValueError(
                f"{config_path}: {key}={token!r} is not a token of tokenizer.json; "
                "set it to the tokenizer's BOS/EOS special token"
            )
        ids.append(token_id)
    return ids[0], ids[1]


def load_model_state(checkpoint_dir: Path, model_config: Any) -> dict[str, torch.Tensor]:
    """Read the model tensors of a DCP checkpoint into full CPU tensors, no process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with torch.device("meta"):
        expected = model_config.build().state_dict()
    metadata = dcp.FileSystemReader(str(checkpoint_dir)).read_metadata()
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
    state: dict[str, torch.Tensor] = {}
    for key, meta_tensor in expected.items():
        md = stored[key]
        assert isinstance(md, TensorStorageMetadata), key
        if tuple(md.size) != tuple(meta_tensor.shape):
            raise ValueError(
                f"{checkpoint_dir}: {key} has shape {tuple(md.size)} in the checkpoint but "
                f"{tuple(meta_tensor.shape)} in the run's model config"
            )
        state[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    # With no process group DCP loads in a single process and reshards every saved
    # FSDP/TP shard into these full tensors.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(checkpoint_dir)))
    return state


def to_hf_state(state: dict[str, torch.Tensor], model_config: Any) -> dict[str, torch.Tensor]:
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    adapter = Llama3StateDictAdapter(model_config, None)
    hf_state = adapter.to_hf(state)
    # to_hf skips names it has no mapping for; only the tied lm_head may go missing.
    num_tied = 1 if model_config.enable_weight_tying else 0
    assert len(hf_state) == len(state) - num_tied, sorted(state)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in hf_state.items()}


def _holds_model(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def _check_out_dir(out_dir: Path, checkpoint_dir: Path, force: bool) -> None:
    out_abs, ckpt_abs = out_dir.resolve(), checkpoint_dir.resolve()
    checkpoints_root = ckpt_abs.parent
    if out_abs == checkpoints_root or checkpoints_root in out_abs.parents:
        raise ValueError(
            f"--out {out_dir} is inside the run's checkpoint folder {checkpoints_root}; "
            "torchtitan would then take it for a checkpoint and fail to resume. "
            "Export somewhere else, e.g. RUN/hf/step-N"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} exists and is not a folder")
    if _holds_model(out_dir) and not force:
        info_path = out_dir / EXPORT_INFO
        what = "files"
        if info_path.is_file():
            info = json.loads(info_path.read_text())
            what = f"an export of {info.get('source_checkpoint')}"
        raise ValueError(f"--out {out_dir} already holds {what}; pass --force to replace it")


def export_checkpoint(
    checkpoint_dir: Path | str,
    out_dir: Path | str,
    source: ExportSource | None = None,
    force: bool = False,
) -> Path:
    """Export `checkpoint_dir` to a Hugging Face Llama folder `out_dir`; returns it."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    step = checkpoint_step(checkpoint_dir)
    check_complete(checkpoint_dir)
    _check_out_dir(out_dir, checkpoint_dir, force)
    if source is None:
        source = source_from_run(checkpoint_dir)
    config = hf_config(source)  # validates the tokenizer before the slow part

    progress = tqdm(total=4, desc=f"export step-{step}", unit="stage", file=sys.stderr)
    progress.set_postfix_str("reading DCP")
    state = load_model_state(checkpoint_dir, source.model_config)
    progress.update()
    progress.set_postfix_str("to_hf")
    hf_state = to_hf_state(state, source.model_config)
    del state
    progress.update()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        from safetensors.torch import save_file

        progress.set_postfix_str("safetensors")
        save_file(hf_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        progress.update()
        progress.set_postfix_str("config + tokenizer")
        write_json_atomic(tmp / "config.json", config)
        write_json_atomic(
            tmp / "generation_config.json",
            {
                "bos_token_id": config["bos_token_id"],
                "eos_token_id": config["eos_token_id"],
                "do_sample": False,
            },
        )
        num_copied = 0
        for name in TOKENIZER_FILES:
            if (source.tokenizer_dir / name).is_file():
                shutil.copy2(source.tokenizer_dir / name, tmp / name)
                num_copied += 1
        assert num_copied >= 2, "special_token_ids() already required both tokenizer files"
        num_params = sum(v.numel() for v in hf_state.values())
        write_json_atomic(
            tmp / EXPORT_INFO,
            {
                "source_checkpoint": str(checkpoint_dir.resolve()),
                "step": step,
                "exported_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "num_params": num_params,
                "dtype": "bfloat16",
                "tokenizer_dir": str(source.tokenizer_dir.resolve()),
            },
        )
        for f in tmp.iterdir():  # safetensors' own writer does not fsync
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        progress.update()
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
    parser = argparse.ArgumentParser(
        prog="python -m eval.export", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--checkpoint", required=True, type=Path, help="RUN/checkpoint/step-N")
    parser.add_argument("--out", required=True, type=Path, help="folder to write the HF model to")
    parser.add_argument("--force", action="store_true", help="replace an existing export")
    args = parser.parse_args(argv)

    def body() -> None:
        print(export_checkpoint(args.checkpoint, args.out, force=args.force))

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
