"""Every shipped config trains and checkpoints at toy size; the 70B one also resumes on
another layout.

Only the model dims and the world size shrink; every other flag of the config is its own:
FP8 recipe and FP8 all-gather, activation checkpointing mode, torch.compile (inductor runs
on CPU), checkpoint mode (async DCP daemon), weight tying, and the parallel degrees scaled
to 2 or 4 processes (70B's FSDP x TP8 becomes FSDP 2 x TP 2). Two flags of the 70B config
does not run here, and its test says so rather than hiding it: async TP needs CUDA
symmetric memory (`torchtitan/distributed/compile.py` `enable_symm_mem_for_group`), so
`compile.async_tp = false` (GPU only).

torch.compile with TP and activation checkpointing (full or selective) used to fail in AOT
autograd ("expected all tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh"): a
torch 2.13 partitioner bug on devices without graph-safe RNG, hit through SDPA's seeded CPU
kernel (docs/upstream/compile_tp_ac.md). `DocumentMaskedSDPA` now runs SDPA's math backend,
so the 8B config (compile + selective AC + FP8) trains here on TP 2, and the 70B config
(compile + full AC + FP8 all-gather) trains on FSDP 2 x TP 2 and resumes on FSDP 2. These
cases are also the suite's proof of TP -> FSDP resharding and of the FP8 all-gather in a
real run (tests/train/test_gpu_path.py checks the float8 payload itself).

Each config: one launch trains 2 steps and saves (async, through the DCP daemon). Only the
70B config resumes, in a second launch on FSDP 2, and trains 1 more step: a resume on
another layout is a property of DCP and the trainer, not of a config's flags, so one
config proves it here (the 2-D FSDP x TP -> FSDP reshard, the widest of them) and the
others' resumes would re-prove it (FSDP 2 -> 1 rank: tests/train/test_train_distributed.py;
3 -> 1 ranks with a seq_len change: the chaos run, tests/utils/chaos.py; CP 2 -> FSDP 2 x
CP 2: tests/train/test_seq_len_stage.py). The resume runs eager (`compile.enable = false`):
the compiled 70B step already ran in the first launch, and compiling again on the new
layout would cost ~a minute of CI for no property of the resume.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.runs import (
    REPO,
    check_ok,
    complete_steps,
    run_config,
    torchrun,
    train_losses,
    write_config,
)
from tests.utils.tiny_model import TINY_TRAIN_MODEL_4_HEADS
from train.config import load_config

pytestmark = pytest.mark.slow

# name -> (launch: nproc and [parallelism], resume: nproc and [parallelism] or None, extra)
# debug.toml (extends base.toml) is what every other training test runs, unshrunk but for
# seq/batch: FSDP 2 -> 1 rank resume in test_train_distributed.py.
LAYOUTS = {
    "llama3_1b": ((2, {}), None, {}),  # FSDP 2: compile + selective AC, bf16 GEMMs
    # TP 2: compile + selective AC + FP8 under tensor parallelism
    "llama3_8b_fp8": ((2, {"tp": 2}), None, {}),
    "llama3_70b_fp8": (
        (4, {"tp": 2}),  # FSDP 2 x TP 2 (TP8 within a node, scaled)
        (2, {"tp": 1}),  # -> FSDP 2
        {"compile": {"async_tp": False}},  # see the module docstring
    ),
}


def shrunk(name: str, data: Path, folder: Path, parallelism: dict, extra: dict) -> dict:
    """The shipped config with toy model dims, our data, 2 steps; its flags unchanged."""
    run = load_config(REPO / "configs" / f"{name}.toml")
    heads = 4 if run.model.n_heads >= 4 else run.model.n_heads
    overrides = {
        # dims: multiples of 16 so every FP8-eligible linear stays FP8; head_dim 16
        "model": TINY_TRAIN_MODEL_4_HEADS
        | {"n_heads": heads, "vocab_size": 2048, "max_seq_len": 512},
        "validation": {"enable": False},
        "training": {"steps": 2, "seq_len": 64, "local_batch_size": 2, "global_batch_size": 4},
        "lr_scheduler": {"warmup_steps": 1},
        "checkpoint": {"interval": 2},
        "metrics": {"log_freq": 1},
        "parallelism": parallelism,
    }
    return run_config(data, folder, overrides, extra, extends=name)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_shipped_config_shrunk_trains_and_saves_and_70b_resumes_on_another_layout(
    name, shakespeare_data, tmp_path
):
    (first_nproc, first_layout), resume_layout, extra = LAYOUTS[name]
    run_dir = tmp_path / "run"
    first = tmp_path / "first.toml"
    write_config(first, shrunk(name, shakespeare_data, run_dir, first_layout, extra))
    proc = torchrun(first, first_nproc, timeout=900)
    check_ok(proc)
    output = proc.stdout + proc.stderr
    original = load_config(REPO / "configs" / f"{name}.toml")
    ran = load_config(run_dir / "config.toml")
    # the config's own flags reached the run
    compile_expected = extra.get("compile", {}).get("enable", original.compile.enable)
    assert ran.fp8 == original.fp8 and ran.compile.enable == compile_expected
    if compile_expected:
        assert "Compiling each TransformerBlock with torch.compile" in output, output[-3000:]
    assert ran.activation_checkpoint == original.activation_checkpoint
    assert ran.checkpoint.async_mode == original.checkpoint.async_mode == "auto"
    assert ran.model.weight_tying == original.model.weight_tying
    assert ran.parallelism.tp == first_layout.get("tp", original.parallelism.tp)
    if original.fp8.enable:
        assert "real float8 GEMMs" in output
    if original.fp8.enable and original.fp8.recipe == "tensorwise":
        fsdp = first_layout.get("dp_shard", -1) != 1 and first_nproc > first_layout.get("tp", 1)
        assert ("FSDP float8 all-gather on for" in output) == fsdp, output[-3000:]
    assert sorted(train_losses(run_dir)) == [1, 2]
    assert complete_steps(run_dir) == [2]
    if resume_layout is None:
        return

    resume_nproc, resume_parallelism = resume_layout
    resume = tmp_path / "resume.toml"
    config = shrunk(name, shakespeare_data, run_dir, resume_parallelism, extra)
    config["training"]["steps"] = 3
    config.setdefault("compile", {})["enable"] = False  # see the module docstring
    write_config(resume, config)
    proc = torchrun(resume, resume_nproc, timeout=900)
    check_ok(proc)
    output = proc.stdout + proc.stderr
    assert f"Loading the checkpoint from {run_dir / 'checkpoint' / 'step-2'}" in output
    assert "Training starts at step 3" in output, output[-3000:]
    losses = train_losses(run_dir)
    assert sorted(losses) == [1, 2, 3] and all(v == v for v in losses.values())
    assert complete_steps(run_dir) == [2, 3]
