"""The launch rules: what a launch of N ranks refuses before anything is built.

Why a module of its own: these rules need the world size, which the schema
(`train.config`) never sees, and every launcher asks them before torch is imported:
`python -m train` at each launch and at `--check` (through `train.preflight`),
`scripts/slurm/submit.py` before it writes an sbatch script, `scripts/quickstart.py` when
it picks a process plan, and the dry run (`train.plan.dry_run`) before it traces anything.
So the module is torch-free, like the schema it reads, and each rule lives here once, with
one message naming the keys to change.

What it restates: each rule is one the installed torchtitan `Trainer` runs at
construction (`ParallelDims`'s degrees, the n_kv_heads check of TP, the trainer's
seq_len and batch checks), checked here first so that a bad `tp` on 64 GPUs fails in a
second with the key to change, not after the model is built with torchtitan's assert.
tests/train/test_launch_rules.py constructs torchtitan's own Trainer on its fake comm
backend for a grid of cases and holds both verdicts equal, case by case.
"""

from __future__ import annotations

import math

from train.config import ConfigError, RunConfig


def check_launch(run: RunConfig, world_size: int) -> dict[str, int]:
    """The rules that need the world size, for a launch and a dry run alike (one message per
    rule): the parallel degrees with dp_shard=-1 resolved, or a ConfigError naming the keys."""
    p = run.parallelism
    if world_size < 1:
        raise ConfigError(f"the world size must be at least 1, got {world_size}")
    others = p.dp_replicate * p.tp * p.cp
    if p.dp_shard == -1:
        if world_size % others:
            raise ConfigError(
                f"parallelism: dp_replicate x tp x cp = {p.dp_replicate} x {p.tp} x {p.cp} = "
                f"{others} does not divide the world size {world_size}; launch a multiple of "
                f"{others} ranks or change parallelism.tp/cp/dp_replicate"
            )
        dp_shard = world_size // others
    else:  # >= 1: the config's sign rule (`train.config.schema`)
        dp_shard = p.dp_shard
        if others * dp_shard != world_size:
            raise ConfigError(
                f"parallelism: dp_replicate x dp_shard x tp x cp = {p.dp_replicate} x "
                f"{dp_shard} x {p.tp} x {p.cp} = {others * dp_shard}, but the world size is "
                f"{world_size}; set parallelism.dp_shard = -1 (the rest) or launch "
                f"{others * dp_shard} ranks"
            )
    degrees = {"dp_replicate": p.dp_replicate, "dp_shard": dp_shard, "tp": p.tp, "cp": p.cp}
    _check_heads(run, p.tp)
    _check_seq_len(run, p.tp, p.cp)
    _check_batch(run, degrees, world_size)
    return degrees


def check_tp_in_node(tp: int, ranks_per_node: int, world_size: int) -> None:
    """TP all-reduces activations several times per layer, which only a node's own links
    (NVLink) carry at speed; torchtitan puts TP innermost in the mesh, so a TP group stays
    inside a node exactly when the node's ranks are a multiple of tp. A launch that spans
    nodes and breaks that trains several times slower without failing: refused."""
    if world_size > ranks_per_node and ranks_per_node % tp:
        raise ConfigError(
            f"parallelism.tp = {tp} does not divide the {ranks_per_node} ranks per node of this "
            f"{world_size}-rank launch, so TP groups would span nodes (their per-layer "
            f"all-reduces over the network); set parallelism.tp to a divisor of {ranks_per_node}"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def admitted_dp_degrees(global_batch_size: int, local_batch_size: int) -> list[int]:
    """The data-parallel degrees (dp_replicate x dp_shard) at which torchtitan accepts this
    batch: those where local x dp divides the global batch, the rest made up by gradient
    accumulation. (With global_batch_size -1, local x dp, every degree is admitted.)"""
    assert global_batch_size > 0 and local_batch_size > 0
    if global_batch_size % local_batch_size:
        return []
    return divisors(global_batch_size // local_batch_size)


def _check_batch(run: RunConfig, degrees: dict[str, int], world_size: int) -> None:
    """torchtitan's Trainer splits the global batch into whole micro-batches of
    local_batch_size per data-parallel rank (torchtitan/trainer.py:414-427, 0.3.0):
    global_batch_size % (local_batch_size x dp) == 0 with dp = dp_replicate x dp_shard (its
    "batch" mesh: tp and cp ranks share a batch), a negative global meaning local x dp.
    tests/train/test_launch_rules.py holds this against the installed Trainer. Replica
    groups (`world_size` is one group's) multiply dp: each group trains its slices of
    every step (`train.replica_groups.trainer` asserts this rule at construction)."""
    t = run.training
    glob, local = t.global_batch_size, t.local_batch_size
    if glob == 0:
        raise ConfigError(
            "training.global_batch_size must be -1 (local_batch_size x data-parallel degree) "
            "or a positive number of sequences, got 0"
        )
    groups = max(1, run.replica_groups.groups)
    dp = degrees["dp_replicate"] * degrees["dp_shard"] * groups
    if glob < 0 and groups > 1:  # -1 is one group's local x dp: a step no group can split
        raise ConfigError(
            f"training.global_batch_size=-1 with replica_groups.groups {groups}: -1 is one "
            f"group's batch, which the groups cannot split; set it to a multiple of {local * dp}"
            f" (training.local_batch_size {local} x data-parallel degree {dp // groups} x "
            f"{groups} groups)"
        )
    per_step = local * dp
    if glob < 0 or glob % per_step == 0:
        return
    fixes = []
    if glob % dp == 0:
        best_local = max(d for d in divisors(glob // dp) if d <= local)
        fixes.append(f"training.local_batch_size {best_local}")
    lower, upper = glob - glob % per_step, glob - glob % per_step + per_step
    fixes.append(f"training.global_batch_size {f'{lower} or {upper}' if lower else upper}")
    admitted = [d for d in admitted_dp_degrees(glob, local) if d % groups == 0]
    if admitted:
        model_parallel = degrees["tp"] * degrees["cp"]
        fixes.append(
            f"a data-parallel degree in {_short_list(admitted)} (world size "
            f"{_short_list([d // groups * model_parallel for d in admitted])}"
            f"{' a group' if groups > 1 else ''} with tp x cp = {model_parallel})"
        )
    of_groups = f" x replica_groups.groups {groups}" if groups > 1 else ""
    raise ConfigError(
        f"training.global_batch_size={glob} is not a multiple of training.local_batch_size="
        f"{local} x data-parallel degree {dp} (parallelism.dp_replicate {degrees['dp_replicate']} "
        f"x parallelism.dp_shard {degrees['dp_shard']}{of_groups} at world size {world_size}"
        f"{' a group' if groups > 1 else ''}) = {per_step}; use {', or '.join(fixes)}"
    )


def _short_list(values: list[int]) -> str:
    return "{" + ", ".join(map(str, values)) + "}"


def _check_heads(run: RunConfig, tp: int) -> None:
    """TP splits attention by heads: tp must divide both n_heads and n_kv_heads."""
    m = run.model
    if m.n_heads % tp or m.n_kv_heads % tp:
        raise ConfigError(
            f"parallelism.tp={tp} must divide model.n_heads={m.n_heads} and "
            f"model.n_kv_heads={m.n_kv_heads}; use a tp that divides {m.n_kv_heads}"
        )


def _check_seq_len(run: RunConfig, tp: int, cp: int) -> None:
    """Context parallelism gives each of cp ranks a shard of the sequence (2 load-balanced
    chunks) and of the document block mask, in whole 128-token blocks (torch's
    `_create_cp_block_mask`, on every device; it refuses other lengths at the first step);
    sequence parallelism splits a rank's shard over tp. So a seq_len is a multiple of
    cp x lcm(128, tp) (of tp alone without CP)."""
    sp = run.parallelism.enable_sequence_parallel and tp > 1
    cp_block = 128  # torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE
    divisor = (cp if cp > 1 else 1) * math.lcm(cp_block if cp > 1 else 1, tp if sp else 1)
    for key, seq_len in run.seq_lens.items():
        if not seq_len % divisor:
            continue
        parts = []
        if sp:
            parts.append(f"parallelism.tp={tp} with enable_sequence_parallel")
        if cp > 1:
            parts.append(f"{cp_block}-token mask blocks x parallelism.cp={cp}")
        lower = seq_len - seq_len % divisor
        raise ConfigError(
            f"{key}={seq_len} is not divisible by {divisor} "
            f"({' x '.join(parts)}); use seq_len {lower or divisor} or {lower + divisor}"
        )
