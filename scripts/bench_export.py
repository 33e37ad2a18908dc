"""Peak memory and wall time of DCP -> Hugging Face export, against model size.

Why: a 70B checkpoint is ~282 GB of fp32 weights. An exporter that loads the whole model
(the old `eval.export`, or torchtitan's own `last_save_in_hf` path, which converts the
in-memory state dict) needs that much RAM plus the bf16 copy; the streaming exporter
needs one shard plus one read group, whatever the model size. This measures all three
on real checkpoints written by this project's trainer, side by side, in one run:

- `streaming`: `python -m eval.export` as users run it (at `--max-shard-size 1GB` and at
  the default 5GB; below 5 GB of bf16 the default writes a single shard).
- `single_shot`: the previous `eval.export` (one `dcp.load` of every model tensor, the
  adapter on the whole state, one `model.safetensors`), copied here from commit 8166cc5.
- `torchtitan_hf`: what `checkpoint.last_save_in_hf` does at the end of training (the
  model-only state cast to `export_dtype`, `Llama3StateDictAdapter.to_hf`, `dcp.save`
  with DCP's `HuggingFaceStorageWriter`), run offline after loading the full state.
- `imports`: the interpreter with torch/torchtitan/safetensors imported: the fixed cost.

Checkpoints: `configs/llama3_1b.toml` (Llama 3.2 1B shape: 1.24B parameters at 16
layers) with only seq_len/batch shrunk, and fewer layers for the smaller sizes. They are
torchtitan seed checkpoints (`checkpoint.create_seed_checkpoint`, model only, fp32) built
through `train.build.to_trainer_config` and saved by the trainer's CheckpointManager:
one CPU training step of the 1B model needs ~20 GB for weights, grads and AdamW state,
more than this shared machine can give, and the export reads only the model tensors anyway.

Each measurement is its own process; peak RSS is that process' `ru_maxrss` (os.wait4).

    .venv/bin/python scripts/bench_export.py --work /tmp/bench_export --layers 4 16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import report_head, report_header, shakespeare, write_report  # noqa: E402

GIB = 1 << 30


def make_checkpoint(work: Path, data: Path, n_layers: int) -> Path:
    """RUN/checkpoint/step-0 of llama3_1b at `n_layers` layers, written by the trainer."""
    from common.run_layout import checkpoint_dir, is_complete_checkpoint

    run_dir = work / f"run_{n_layers}l"
    step_dir = checkpoint_dir(run_dir, 0)
    if is_complete_checkpoint(step_dir, dcp_only=True):
        return step_dir
    code = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
from train.runtime import prepare_runtime
prepare_runtime()  # what python -m train does first
from train.build import to_trainer_config
from train.config import load_config, save_config
overrides = [
    "--job.folder", {str(run_dir)!r}, "--dataloader.tokenizer", {str(data / "tokenizer")!r},
    "--set", "dataloader.mix=[{{path='{data / "train"}'}}]",
    "--set", "validation.mix=[{{path='{data / "val"}'}}]",
    "--training.seq_len=256", "--training.local_batch_size=1",
    "--training.global_batch_size=1", "--model.n_layers={n_layers}",
    "--checkpoint.last_save_model_only=true",
]
run = load_config({str(ROOT / "configs" / "llama3_1b.toml")!r}, overrides)
run.run_dir.mkdir(parents=True, exist_ok=True)
save_config(run, run.run_dir / "config.toml")
config = to_trainer_config(run)
config.checkpoint.create_seed_checkpoint = True
trainer = config.build()
trainer.checkpointer.save(curr_step=0, last_step=True)
trainer.close()
"""
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    assert is_complete_checkpoint(step_dir, dcp_only=True), step_dir
    return step_dir


# --- the methods, each run in a child process -------------------------------------------


def _model_state(checkpoint: Path):
    """(model config, every model tensor of the checkpoint, full, in one read)."""
    from eval.export import load_model_state, source_from_run

    model_config = source_from_run(checkpoint).model_config
    return model_config, load_model_state(checkpoint, model_config)


def method_single_shot(checkpoint: Path, out: Path) -> None:
    """The previous eval.export weights path (commit 8166cc5), config/tokenizer omitted."""
    import torch
    from safetensors.torch import save_file
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    model_config, state = _model_state(checkpoint)
    hf_state = Llama3StateDictAdapter(model_config, None).to_hf(state)
    hf_state = {k: v.to(torch.bfloat16).contiguous() for k, v in hf_state.items()}
    del state
    out.mkdir(parents=True)
    save_file(hf_state, str(out / "model.safetensors"), metadata={"format": "pt"})


def method_torchtitan_hf(checkpoint: Path, out: Path) -> None:
    """torchtitan's last_save_in_hf: DCPCheckpointer._save_last_step + dcp_save(to_hf=True)
    with export_dtype=bfloat16, on the model state loaded from the checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    model_config, state = _model_state(checkpoint)
    # _save_last_step: the model-only state cast to export_dtype
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    hf_state = Llama3StateDictAdapter(model_config, None).to_hf(state)
    # dcp_save(to_hf=True) with no fqn_to_index_mapping: one consolidated file
    writer = HuggingFaceStorageWriter(
        path=str(out), save_distributed=True, fqn_to_index_mapping=None, enable_consolidation=True
    )
    dcp.save(hf_state, storage_writer=writer)


def method_imports(checkpoint: Path, out: Path) -> None:
    import importlib

    for name in ("safetensors.torch", "torch.distributed.checkpoint", "torchtitan.models.llama3"):
        importlib.import_module(name)
    importlib.import_module("eval.export")


METHODS = {
    "imports": None,
    "streaming_1GB": ["--max-shard-size", "1GB"],
    "streaming_5GB": ["--max-shard-size", "5GB"],
    "single_shot": None,
    "torchtitan_hf": None,
}


def measure(method: str, checkpoint: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    if method.startswith("streaming"):
        cmd = [sys.executable, "-m", "eval.export", "--checkpoint", str(checkpoint)]
        cmd += ["--out", str(out), *METHODS[method]]
    else:
        cmd = [sys.executable, __file__, "--child", method, str(checkpoint), str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    assert os.waitstatus_to_exitcode(status) == 0, (method, status)
    files = sorted(out.glob("*.safetensors")) if out.exists() else []
    row = {
        "method": method,
        "wall_s": round(wall, 1),
        "peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 3),
        "num_safetensors": len(files),
        "largest_file_gib": round(max((f.stat().st_size for f in files), default=0) / GIB, 3),
    }
    shutil.rmtree(out, ignore_errors=True)
    return row


def checkpoint_facts(step_dir: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    sizes = {k: m.size.numel() * m.properties.dtype.itemsize for k, m in md.items()}
    return {
        "num_params": sum(m.size.numel() for m in md.values()),
        "fp32_gib": round(sum(sizes.values()) / GIB, 3),
        "largest_tensor_fp32_gib": round(max(sizes.values()) / GIB, 3),
    }


def to_markdown(result: dict) -> str:
    lines = [
        *report_header(result, "DCP -> Hugging Face export: peak memory and time vs model size"),
        f"- machine: {result['machine']}",
        f"- command: `{result['command']}`",
        "",
        "Checkpoints: `configs/llama3_1b.toml` (seq_len/batch shrunk, fewer layers for the "
        "smaller size), torchtitan seed checkpoints written by the trainer's "
        "CheckpointManager (model only, fp32). Peak RSS is each process' ru_maxrss.",
        "",
        "| layers | params | fp32 on disk | method | peak RSS | wall | files (largest) |",
        "| ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for size in result["sizes"]:
        for row in size["rows"]:
            lines.append(
                f"| {size['n_layers']} | {size['num_params'] / 1e9:.2f}B | "
                f"{size['fp32_gib']:.2f} GiB | {row['method']} | {row['peak_rss_gib']:.2f} GiB | "
                f"{row['wall_s']:.0f} s | {row['num_safetensors']} "
                f"({row['largest_file_gib']:.2f} GiB) |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_export"))
    p.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "export.json")
    p.add_argument("--machine-note", default="")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints in --work")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        method, checkpoint, out = args.child
        globals()[f"method_{method}"](Path(checkpoint), Path(out))
        return 0

    sys.path.insert(0, str(ROOT))
    args.work.mkdir(parents=True, exist_ok=True)
    data = shakespeare(args.work / "data", val_fraction=0.05)
    packages = ("torch", "torchtitan", "safetensors", "transformers")
    result = report_head("export", "bench_export.py", argv or sys.argv[1:], packages)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    note = f"; {args.machine_note}" if args.machine_note else ""
    result["machine"] = f"{memory:.0f} GiB memory{note}"
    result["sizes"] = []
    for n_layers in args.layers:
        step_dir = make_checkpoint(args.work, data, n_layers)
        size = {"n_layers": n_layers, **checkpoint_facts(step_dir), "rows": []}
        for method in METHODS:
            row = measure(method, step_dir, args.work / "hf")
            print(json.dumps({"n_layers": n_layers, **row}), flush=True)
            size["rows"].append(row)
        result["sizes"].append(size)
        if not args.keep:
            shutil.rmtree(step_dir.parent.parent)
    write_report(args.out.with_suffix(""), result, to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
