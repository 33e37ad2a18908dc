"""The launch rules: what torchtitan's Trainer refuses at construction, the plan refuses too,
in one line naming the keys, through the same `train.launch_rules.check_launch` a launch calls.

- The rules are held against the installed Trainer itself: it is constructed on torchtitan's
  fake comm backend ("fake_backend", any world size, no memory) up to the point where the
  model would be parallelized, and its verdict must equal `check_launch`'s case by case.
- Every shipped config takes every world size its header and the docs advertise, and the
  quickstart's process plan holds for 1, 2, 4 and 8 GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.config import ConfigError, load_config
from train.launch_rules import admitted_dp_degrees, check_launch

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

# World sizes each shipped config advertises (its header, README.md, docs/launching.md).
ADVERTISED = {
    "debug.toml": [1, 2, 4, 8],  # scripts/train_local.sh: one process per GPU
    "llama3_1b.toml": [8],
    "llama3_8b_fp8.toml": [4, 8, 32, 64],  # launching.md NPROC=4, README submit 4 x 8 nodes
    "llama3_70b_fp8.toml": [32, 64, 128],
}


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRAIN_DEBUG", None)
    cmd = [sys.executable, "-m", "train", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("config", "world_size", "overrides"),
    [
        ("llama3_8b_fp8.toml", 48, []),
        (
            "debug.toml",
            8,
            ["--training.global_batch_size", "8", "--training.local_batch_size", "4"],
        ),
    ],
)
def test_dry_run_refuses_a_batch_torchtitan_refuses_in_one_line(config, world_size, overrides):
    proc = _cli(
        "--config",
        f"configs/{config}",
        "--dry-run",
        "--world-size",
        str(world_size),
        "--gpu",
        "h100",
        *overrides,
    )
    assert proc.returncode != 0
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: training.global_batch_size=")
    assert "training.local_batch_size" in line and "parallelism.dp_shard" in line
    assert "Traceback" not in proc.stdout + proc.stderr


def test_batch_message_offers_values_that_pass():
    debug = CONFIGS / "debug.toml"
    bad = ["--training.global_batch_size", "8", "--training.local_batch_size", "4"]
    with pytest.raises(ConfigError) as refused:
        check_launch(load_config(debug, bad), 8)
    message = str(refused.value)
    assert "use training.local_batch_size 1, or training.global_batch_size 32" in message
    assert "or a data-parallel degree in {1, 2} (world size {1, 2}" in message
    for fix in (["--training.local_batch_size", "1"], ["--training.global_batch_size", "32"]):
        check_launch(load_config(debug, bad + fix), 8)
    for world_size in (1, 2):
        check_launch(load_config(debug, bad), world_size)
    with pytest.raises(ConfigError, match="training.global_batch_size must be -1"):
        check_launch(load_config(debug, ["--training.global_batch_size", "0"]), 2)


def test_replica_groups_multiply_the_data_parallel_degree():
    """A launch's world is one group's, and every group trains its slices of each step: the
    replica trainer refuses at construction (after the workers start) an accumulation the
    groups cannot split; the launch rule refuses it first. debug: global 8, local 1."""
    debug = CONFIGS / "debug.toml"

    def check(world_size: int, groups: int, *extra: str) -> None:
        check_launch(
            load_config(debug, ["--replica_groups.groups", str(groups), *extra]), world_size
        )

    for world_size, groups in ((1, 2), (4, 2), (2, 4), (1, 8)):
        check(world_size, groups)
    for world_size, groups, fragment in (
        (8, 2, "degree 16 (parallelism.dp_replicate 1 x parallelism.dp_shard 8 x replica_groups"
         ".groups 2 at world size 8 a group) = 16; use training.global_batch_size 16, or a "
         "data-parallel degree in {2, 4, 8} (world size {1, 2, 4} a group"),
        (1, 3, "x replica_groups.groups 3 at world size 1 a group"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as refused:
            check(world_size, groups)
        assert fragment in str(refused.value)
    with pytest.raises(ConfigError, match="-1 is one group's batch.*a multiple of 4"):
        check(2, 2, "--training.global_batch_size", "-1")


def test_pure_ddp_plans_without_error():
    """Defect 5: dp_replicate 8 x dp_shard 1 resolved "auto" to spmd_types, which FSDP
    refuses ("all parameters must be DTensors on the full SPMD mesh"). The debug model
    plans in a few seconds; llama3_1b.toml (issue 18's case) fails and passes the same way."""
    proc = _cli(
        "--config",
        "configs/debug.toml",
        "--dry-run",
        "--world-size",
        "8",
        "--gpu",
        "h100",
        "--parallelism.dp_replicate",
        "8",
        "--parallelism.dp_shard",
        "1",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dp_replicate=8 x dp_shard=1" in proc.stdout
    assert "spmd_backend=partial_dtensor" in proc.stdout


@pytest.mark.parametrize("name", sorted(ADVERTISED))
def test_shipped_configs_take_every_advertised_world_size(name):
    run = load_config(CONFIGS / name)
    for world_size in ADVERTISED[name]:
        check_launch(run, world_size)


def test_8b_resumes_on_the_data_parallel_degrees_the_docs_state():
    """docs/training.md and README.md: the 8B batch (global 64, local 1) takes 1-64 ranks by
    powers of 2; 48, for example, is refused."""
    run = load_config(CONFIGS / "llama3_8b_fp8.toml")
    t = run.training
    assert admitted_dp_degrees(t.global_batch_size, t.local_batch_size) == [1, 2, 4, 8, 16, 32, 64]
    for doc in ("README.md", "docs/training.md"):
        assert "1, 2, 4, 8, 16, 32 or 64" in (REPO / doc).read_text(), doc
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        check_launch(run, 48)


@pytest.mark.parametrize("num_gpus", [0, 1, 2, 4, 8])
def test_quickstart_process_plan_is_admitted_by_the_launch_rule(num_gpus):
    sys.path.insert(0, str(REPO / "scripts"))
    from quickstart import process_plan

    run = load_config(CONFIGS / "debug.toml")
    before, after, local = process_plan(num_gpus, run)
    assert before == (num_gpus or 2)
    # a reshard to fewer processes wherever there are two or more
    assert after < before or before == 1
    for procs in (before, after):
        run.training.local_batch_size = local
        check_launch(run, procs)
    expected = {0: (2, 1, 4), 1: (1, 1, 8), 2: (2, 1, 4), 4: (4, 2, 2), 8: (8, 4, 1)}
    assert (before, after, local) == expected[num_gpus]


# --------------------------------------------------------------------- against torchtitan

# (world size, overrides of configs/debug.toml): every rule check_launch restates from the
# Trainer's construction, on both sides of each.
TORCHTITAN_CASES = [
    (8, {"global_batch_size": 8, "local_batch_size": 4}),
    (8, {"global_batch_size": 8, "local_batch_size": 1}),
    (8, {"global_batch_size": -1, "local_batch_size": 4}),
    (8, {"global_batch_size": 0, "local_batch_size": 1}),
    (8, {"global_batch_size": 8, "local_batch_size": 2, "tp": 2}),
    (8, {"global_batch_size": 8, "local_batch_size": 4, "tp": 2}),
    (8, {"global_batch_size": 8, "local_batch_size": 2, "dp_replicate": 2}),
    (8, {"global_batch_size": 16, "local_batch_size": 2, "dp_replicate": 2}),
    (8, {"global_batch_size": 8, "local_batch_size": 2, "cp": 2}),
    (8, {"global_batch_size": 8, "local_batch_size": 4, "cp": 2}),
    (8, {"global_batch_size": 8, "local_batch_size": 1, "dp_shard": 3}),
    (8, {"global_batch_size": 8, "local_batch_size": 1, "tp": 2, "seq_len": 255}),
    (8, {"global_batch_size": 8, "local_batch_size": 1, "tp": 8}),
    (6, {"global_batch_size": 8, "local_batch_size": 1}),
    (6, {"global_batch_size": 12, "local_batch_size": 2}),
    (2, {"global_batch_size": 8, "local_batch_size": 4}),
    (1, {"global_batch_size": 8, "local_batch_size": 4}),
    (48, {"global_batch_size": 64, "local_batch_size": 1}),
    (64, {"global_batch_size": 128, "local_batch_size": 4, "tp": 4}),
    (64, {"global_batch_size": 128, "local_batch_size": 16, "tp": 4}),
]


def _overrides(case: dict) -> list[str]:
    section = {"tp": "parallelism", "cp": "parallelism", "dp_replicate": "parallelism"}
    section["dp_shard"] = "parallelism"
    return [f"--{section.get(k, 'training')}.{k}={v}" for k, v in case.items()]


def _rule(message: str) -> str:
    """Which rule a refusal is, in check_launch's words or in torchtitan's."""
    for rule, marks in {
        "batch": ("global_batch_size", "global batch size"),
        "degrees": ("parallelism: dp", "parallelism.dp_shard", "Invalid parallel dims"),
        "seq_len": ("training.seq_len", "sequence length"),
        "heads": ("must divide model.n_heads", "must divide n_kv_heads"),
    }.items():
        if any(mark in message for mark in marks):
            return rule
    return f"unknown: {message}"


def _torchtitan_verdicts(cases: list) -> list[str]:
    """In a fresh process: construct torchtitan's own Trainer for each case on its fake comm
    backend, stopping where the model would be parallelized (every check the Trainer runs
    before then has passed): "ok", or the rule of the exception it raised."""
    import tempfile
    import traceback

    import torch.distributed as dist

    from train.__main__ import prepare_runtime

    prepare_runtime(accelerator=False)
    from torchtitan.trainer import Trainer

    from train.build import to_trainer_config

    class Constructed(Exception):
        pass

    def parallelize(*args, **kwargs):
        raise Constructed

    verdicts = []
    for world_size, case in cases:
        folder = tempfile.mkdtemp()
        run = load_config(CONFIGS / "debug.toml", [*_overrides(case), f"--job.folder={folder}"])
        config = to_trainer_config(run, world_size, accelerator=False)
        config.comm.mode = "fake_backend"
        config.model_spec.parallelize_fn = parallelize
        os.environ.update(NGPU=str(world_size), RANK="0", LOCAL_RANK="0")
        try:
            Trainer(config)
            verdicts.append("constructed without reaching parallelize")
        except Constructed:
            verdicts.append("ok")
        except (AssertionError, ValueError) as e:
            # a bare `assert` says nothing: its source line names what it checks
            verdicts.append(_rule(str(e) or traceback.extract_tb(e.__traceback__)[-1].line))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return verdicts


def test_check_launch_refuses_exactly_what_torchtitans_trainer_refuses():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(TORCHTITAN_CASES)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.splitlines()[-1])
    ours = []
    for world_size, case in TORCHTITAN_CASES:
        run = load_config(CONFIGS / "debug.toml", _overrides(case))
        try:
            check_launch(run, world_size)
            ours.append("ok")
        except ConfigError as e:
            ours.append(_rule(str(e)))
    table = [(w, c, o, t) for (w, c), o, t in zip(TORCHTITAN_CASES, ours, theirs, strict=True)]
    assert ours == theirs, "\n".join(map(str, table))
    # the grid holds both outcomes of every rule
    assert set(theirs) == {"ok", "batch", "degrees", "seq_len", "heads"}


if __name__ == "__main__":
    print(json.dumps(_torchtitan_verdicts(json.loads(sys.argv[1]))))


@pytest.mark.parametrize(
    ("tp", "per_node", "world", "refused"),
    [(8, 8, 64, False), (4, 8, 64, False), (8, 8, 8, False), (8, 4, 16, True), (4, 6, 12, True)],
)
def test_tp_groups_that_would_span_nodes_are_refused(tp, per_node, world, refused):
    """torchtitan puts TP innermost: a TP group stays in a node exactly when tp divides the
    node's ranks (one node: nothing to span)."""
    from train.config import ConfigError
    from train.launch_rules import check_tp_in_node

    if refused:
        with pytest.raises(ConfigError, match=f"parallelism.tp = {tp} does not divide"):
            check_tp_in_node(tp, per_node, world)
    else:
        check_tp_in_node(tp, per_node, world)
