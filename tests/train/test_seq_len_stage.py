"""The shipped long-context stage (configs/llama3_8b_long_context.toml) trains shrunk
through a seq_len change and a reshard at the same time, with context parallelism.

Shrunk as tests/train/test_shipped_configs.py shrinks every shipped config: toy dims and
world size, our data; its own flags stay: CP (2 here, of 8), Llama 3.1 RoPE scaling, FP8
tensorwise with the FP8 all-gather, selective activation checkpointing, a two-dataset mix and
`[[dataloader.schedule]]` phases that raise seq_len and change the mix weights, the "ptrr"
CP load balancer. One flag is turned off for the two launches below, for the suite's time
budget: torch.compile (each new seq_len recompiles on every rank, and 4 ranks recompiling
on 2 cores cost ~2 of this test's 3 minutes). Instead one more launch trains one step of
the stage as shipped, compile on, on 2 ranks (CP 2): the whole long-context kernel path
compiled (document masks under CP with K/V all-gathered inside each compiled block,
selective AC, FP8 tensorwise with the FP8 all-gather), whose loss must be the eager launch's first
loss. Lengths and steps scale down (8K -> 256, phases a step apart):

- launch 1, 2 ranks (CP 2, no data parallelism): steps 1-2 at seq_len 256, then a phase
  raises it to 512 for step 3 (a change in the middle of a run); saves step 3;
- launch 2, 4 ranks (data parallel 2 x CP 2): resumes at step 4, where a phase raises
  seq_len to 1024 with new mix weights (the reshard and the seq_len change at once).
- the compiled launch, 2 ranks (CP 2), step 1 only, into a run folder of its own.

The loader's exactness over such changes is proven in tests/dataloader/
test_seq_len_change.py; this checks the trainer side: the schema's phases reach the
loader at step boundaries on either layout, the model trains at every length under CP,
and the skipped-token counter reaches metrics.jsonl. CP's numerics (document masks under
CP) are tests/train/test_context_parallel.py's.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from tests.train.test_shipped_configs import shrunk
from tests.utils.runs import REPO, check_ok, complete_steps, read_metrics, torchrun, write_config
from train.config import load_config

LONG_CONTEXT = "llama3_8b_long_context"
BLOCK, GROUP = 1024, 8  # a seq_len change drops < GROUP x BLOCK tokens per dataset
# compiled vs eager step 1: measured 1.2e-7 relative (the same grad norm); dropping the
# document mask moved a loss of this size 9e-5 (tests/train/test_context_parallel.py's
# training test), so 1e-5 tells a wrong compiled step from reordered sums
LOSS_RTOL = 1e-5


def long_context_shrunk(shakespeare_data, short_docs_data, run_dir, nproc, compile=False):
    run = load_config(REPO / "configs" / f"{LONG_CONTEXT}.toml")
    mix = [  # the pretraining mix, then the long documents, at the config's own weights
        {"path": str(short_docs_data / "train"), "weight": run.dataloader.mix[0].weight},
        {"path": str(shakespeare_data / "train"), "weight": run.dataloader.mix[1].weight},
    ]
    extra = {
        "model": {"max_seq_len": 1024},
        "training": {"steps": 4, "seq_len": 256, "local_batch_size": 1, "global_batch_size": 2},
        "dataloader": {
            "mix": mix,
            "block_tokens": BLOCK,
            "shuffle_blocks": GROUP,
            "schedule": [
                {"start_step": 3, "seq_len": 512},
                {"start_step": 4, "seq_len": 1024, "weights": [0.6, 0.4]},
            ],
        },
        "checkpoint": {"interval": 3, "keep_last": 0},
        "compile": {"enable": compile},  # see the module docstring
    }
    # dp_shard -1 (the config's): FSDP over the ranks CP leaves
    parallelism = {"cp": 2}
    config = shrunk(LONG_CONTEXT, shakespeare_data, run_dir, parallelism, extra)
    return write_config(run_dir.parent / f"launch{nproc}.toml", config)


@pytest.mark.slow
def test_long_context_stage_shrunk_trains_through_a_seq_len_change_and_a_reshard(
    shakespeare_data, short_docs_data, tmp_path
):
    run_dir = tmp_path / "run"
    first = long_context_shrunk(shakespeare_data, short_docs_data, run_dir, 2)
    proc = torchrun(first, 2, "--training.steps=3", timeout=900)
    check_ok(proc)
    assert "Applied Context Parallel" in proc.stdout + proc.stderr
    assert complete_steps(run_dir) == [3]

    original, ran = (
        load_config(REPO / "configs" / f"{LONG_CONTEXT}.toml"),
        load_config(run_dir / "config.toml"),
    )
    # the shipped config's own flags reached the run
    assert ran.parallelism.cp == 2 and original.parallelism.cp > 1
    assert ran.model.rope_scaling and original.model.rope_scaling
    assert ran.fp8 == original.fp8 and not ran.compile.enable
    assert ran.activation_checkpoint == original.activation_checkpoint
    assert original.activation_checkpoint.mode == "selective"  # the plan's pick (--suggest)

    assert [p.weights for p in original.dataloader.schedule if p.weights] == [[0.6, 0.4]]
    assert ran.parallelism.context_parallel_load_balancer == "ptrr"
    assert original.parallelism.context_parallel_load_balancer == "ptrr"

    # step 1 again, compiled as shipped (original.compile.enable): the same loss
    assert original.compile.enable
    compiled_dir = tmp_path / "compiled"
    compiled = long_context_shrunk(shakespeare_data, short_docs_data, compiled_dir, 2, compile=True)
    started = time.perf_counter()
    proc = torchrun(compiled, 2, "--training.steps=1", "--checkpoint.enable=false", timeout=900)
    compiled_s = time.perf_counter() - started
    check_ok(proc)
    output = proc.stdout + proc.stderr
    assert "Compiling each TransformerBlock with torch.compile" in output
    assert "Applied Context Parallel" in output and "real float8 GEMMs" in output
    assert load_config(compiled_dir / "config.toml").compile.enable
    eager_loss = read_metrics(run_dir, "train")[0]["loss"]
    (compiled_row,) = read_metrics(compiled_dir, "train")
    assert compiled_row["step"] == 1
    torch.testing.assert_close(compiled_row["loss"], eager_loss, rtol=LOSS_RTOL, atol=0)
    print(f"compiled CP step on 2 ranks: {compiled_s:.0f} s (launch, compile, one step)")

    # resume on 4 ranks at step 4, where seq_len doubles and the mix weights change
    resume = long_context_shrunk(shakespeare_data, short_docs_data, run_dir, 4)
    proc = torchrun(resume, 4, timeout=900)
    check_ok(proc)
    assert "Training starts at step 4" in proc.stdout + proc.stderr
    rows = {r["step"]: r for r in read_metrics(run_dir, "train")}
    assert sorted(rows) == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in rows.values())
    # tokens per step = 2 sequences x the phase's seq_len: 256, 256, 512, then 1024
    assert [rows[s]["tokens_seen"] for s in (2, 3, 4)] == [2 * 512, 2 * 1024, 2 * 2048]
    # each change drops at most the rest of one group of blocks per dataset (2 datasets)
    assert rows[2]["data_skipped_tokens"] == 0
    assert 0 < rows[3]["data_skipped_tokens"] <= 2 * GROUP * BLOCK
    assert rows[3]["data_skipped_tokens"] <= rows[4]["data_skipped_tokens"] <= 2 * 2 * GROUP * BLOCK
    assert complete_steps(run_dir) == [3, 4]


def test_long_context_config_plans_its_phases():
    """The shipped long-context stage: 8K -> 32K -> 64K -> 128K phases on 64 GPUs (CP 8),
    RoPE sized for 128K, every length split evenly by CP."""
    from train.build import to_trainer_config
    from train.launch_rules import check_launch

    run = load_config(REPO / "configs" / f"{LONG_CONTEXT}.toml")
    assert check_launch(run, 64) == {"dp_replicate": 1, "dp_shard": 8, "tp": 1, "cp": 8}
    assert run.model.rope_scaling
    config = to_trainer_config(run, world_size=64, accelerator=True)
    assert config.training.seq_len == run.model.max_seq_len == 131072
    # the balancer measured best on packed documents (docs/bench/cp_balance-2026-11-24.md)
    assert config.parallelism.context_parallel_load_balancer == "ptrr"
    plain = load_config(
        REPO / "configs" / f"{LONG_CONTEXT}.toml",
        ["--set", 'parallelism.context_parallel_load_balancer="none"'],
    )
    assert to_trainer_config(plain, 64).parallelism.context_parallel_load_balancer is None
    assert config.dataloader.start_seq_len == 8192
    assert [(p.start_sequence, p.seq_len) for p in config.dataloader.schedule] == [
        (500 * 64, 32768),
        (1500 * 64, 65536),
        (2500 * 64, 131072),
    ]
