"""The checks a launch makes before any process starts: config, world size, data, host.

Why a module of its own, torch-free: the launchers (`scripts/train_local.sh`,
`scripts/slurm/submit.py`, `scripts/slurm/train.sbatch`) run these checks through `python -m
train --check` before torchrun starts, so a typo or a missing data folder is one line in a
second, not a line per rank plus torchrun's traceback after the workers have imported torch.
`python -m train` runs the same function again in every worker (a direct `python -m train`
has no launcher in front of it). A Hugging Face folder given as
`checkpoint.initial_load_path` is checked against [model] here
(`train.components.hf_import`), and the FP8 recipe and format against the node's AMD GPUs
as `amd-smi` names them (`train.fp8.check_fp8_device`). Nothing here imports torch
(tested); the checks that need it (checkpoint shapes, CUDA) stay in the trainer.

The host (`check_host`): what an async checkpoint needs of the machine, before the first
save finds out. DCP's `async_with_pinned_mem` (the default) copies the whole state dict
(model, Adam's two moments and step, per parameter) into shared, pinned host memory at the
first save and keeps that copy for the run (`torch/distributed/checkpoint/
_state_dict_stager.py`), so that later saves reuse it:

- one shared-memory file descriptor per state-dict tensor stays open for the run (torch's
  `file_descriptor` sharing), and each is duplicated once more while the dict is handed to
  DCP's checkpoint daemon: about 1,164 tensors at 8B and 2,892 at 70B, against a soft
  `nofile` limit that is often 1,024 ("Too many open files" at the first save). The soft
  limit is raised here, as vLLM's `set_ulimit` raises it for its servers (to 65,535 there;
  here all the way to the hard limit: a process may raise its own soft limit, only the
  hard one needs an administrator), and a hard limit too small for 2 x tensors plus the
  rest of the process is refused;
- the copy lives in /dev/shm and is pinned: the node's ranks together need their staging
  bytes there and in RAM (about 197 GiB per node at 70B on 32 GPUs, 8 per node); a
  container's small /dev/shm would end the first save with SIGBUS.

The counts come from the config (`staged_state_dict`), derived from how the state dict
really looks and compared with a real one in the tests. `checkpoint.async_mode = "async"`
stages into ordinary memory during each save (RAM only, no file descriptors, no /dev/shm);
"disabled" stages nothing (DCP writes from the training tensors), so only the soft limit
is raised. A host check runs where its answer is true: in `--check` on the launching host
(the batch host for SLURM, a node like the others) and again in every worker at start-up,
where the raised soft limit is the one the worker and its checkpoint daemon then live with.
"""

from __future__ import annotations

import os
import resource
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from common.io import check_folder_writable
from common.launch_env import amd_gpu_archs
from train.components.hf_import import check_initial_load
from train.config import ConfigError, RunConfig
from train.fp8 import check_fp8_device
from train.launch_rules import check_launch, check_tp_in_node
from train.reliability.budgets import PlannedTimes, check_budgets


def check_data(run: RunConfig, degrees: dict[str, int]) -> None:
    """Tokenizer vs model vocab, each dataset vs the configured tokenizer, and the val split
    vs one validation step."""
    from dataloader import Manifest
    from dataloader.tokenizer import load_tokenizer

    tokenizer_json = Path(run.dataloader.tokenizer) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ConfigError(
            f"dataloader.tokenizer: {tokenizer_json} not found; point it at DATA/tokenizer "
            "written by dataloader.prepare"
        )
    vocab = load_tokenizer(tokenizer_json).get_vocab_size(with_added_tokens=True)
    if vocab > run.model.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_json} has {vocab} tokens but model.vocab_size is "
            f"{run.model.vocab_size}; set model.vocab_size >= {vocab}"
        )
    entries = list(run.dataloader.mix) + (list(run.validation.mix) if run.validation.enable else [])
    for entry in entries:
        manifest = Manifest.load(entry.path)
        manifest.check_vocab(run.model.vocab_size)
        manifest.check_tokenizer(tokenizer_json)
    if run.validation.enable and run.validation.steps == -1:
        check_validation_fits(run, degrees["dp_replicate"] * degrees["dp_shard"])


def check_validation_fits(run: RunConfig, dp: int) -> None:
    """validation.steps = -1 makes torchtitan's validator take one pass of the val split (a
    fixed step count wraps it), and it asserts on a pass with no batch: the loader drops a
    step it cannot fill on every rank. Planned by the loader's own order, as one rank whose
    batch is the whole step (local batch x dp sequences)."""
    from dataloader.global_order import Cursor, GlobalOrder
    from dataloader.stream import BlockPosition, DatasetStream

    t, data, mix = run.training, run.dataloader, run.validation.mix or run.dataloader.mix
    blocks = {"block_tokens": data.block_tokens, "shuffle_blocks": data.shuffle_blocks}
    streams = [
        DatasetStream(e.path, i, data.seed, max_seq_len=t.seq_len, one_pass=True, **blocks)
        for i, e in enumerate(mix)
    ]
    size, zeros = t.local_batch_size * dp, (0,) * len(mix)
    order = GlobalOrder(
        streams,
        [e.weight for e in mix],
        [],
        seq_len=t.seq_len,
        dp_world_size=1,
        dp_rank=0,
        local_batch_size=size,
    )
    if order.plan_round(Cursor(0, zeros, 0, zeros, tuple(BlockPosition() for _ in mix))) is None:
        raise ConfigError(
            f"[[validation.mix]] {[e.path for e in mix]}: one pass holds fewer windows of "
            f"training.seq_len {t.seq_len} than one validation step of {size} sequences "
            f"(training.local_batch_size {t.local_batch_size} x data-parallel degree {dp}), and "
            "validation.steps = -1 validates on one pass; prepare a larger val split "
            "(--val-fraction), or set validation.steps to a count (it wraps the split)"
        )


def preflight(run: RunConfig, world_size: int, *, budgets: bool = True) -> None:
    """Everything a launch of `world_size` ranks can check without torch; ValueError if bad.
    `budgets=False`: not against RUN/budgets.json (a forensics replay has a layout and a
    plan of its own, train/forensics/plan.py)."""
    degrees = check_launch(run, world_size)
    check_tp_in_node(degrees["tp"], local_ranks(world_size), world_size)
    check_folder_writable(run.run_dir, "job.folder")
    check_gpu_memory(run, degrees, os.environ.get(GPU_ENV))
    if budgets:
        check_budgets(
            run, world_size, PlannedTimes.read(run.run_dir)
        )  # train/reliability/budgets.py
    check_data(run, degrees)
    check_initial_load(run)
    check_fp8_device(run, amd_gpu_archs())  # MXFP8, a forced FP8 format on AMD GPUs
    check_host(run, degrees)


# --------------------------------------------------------------------------- the host
GIB = 1024**3

# Bytes per parameter element of each staged tensor: the sharded master weight is fp32 on
# every device (FSDP's bf16 is a compute copy, not what is saved), and Adam/AdamW keep two
# moments of the parameter's dtype. Adam's `step` is one fp32 scalar tensor per parameter.
MASTER_WEIGHT_BYTES = 4
ADAM_MOMENTS = 2
ADAM_STEP_BYTES = 4
# state-dict tensors per parameter: the weight, exp_avg, exp_avg_sq, step
TENSORS_PER_PARAMETER = 1 + ADAM_MOMENTS + 1

# Open files a training rank needs besides the staged tensors: 28 measured on a 2-rank CPU
# worker (libraries, data shards, logs, gloo; and the device mesh's rank map, which the
# staging copy reaches through every DTensor and stages too, one per mesh); a GPU rank adds
# the driver's device files and NCCL's sockets. 1,024 (the usual soft limit, the one every
# library is written to live within) covers that; plus one socket per peer rank of the
# gloo group DCP saves over (torch's gloo connects a full mesh).
OTHER_OPEN_FILES = 1024

PINNED = "async_with_pinned_mem"
SHM = Path("/dev/shm")


def resolve_async_checkpoint(requested: str) -> str:
    """ "auto" -> async_with_pinned_mem on every device: DCP's checkpoint daemon writes
    while training goes on. Only the staging copy differs without an accelerator
    (`train.components.dcp_workarounds.pinned_memory_stager`: no non-blocking copy, no pinning)."""
    return PINNED if requested == "auto" else requested


@dataclass(frozen=True)
class StagedStateDict:
    """What one rank's async checkpoint stages: `tensors` (each a shared-memory file
    descriptor for the run, in async_with_pinned_mem) and `bytes` (the largest rank's)."""

    tensors: int
    bytes: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def staged_state_dict(run: RunConfig, degrees: dict[str, int]) -> StagedStateDict:
    """The state dict a rank stages for an async save, from the config.

    Derived from the real one (tests/train/components/test_async_checkpoint.py builds it and
    compares): torchtitan's flattened state dict holds each parameter once (a tied lm_head
    is the embedding's tensor), as the rank's local shard of the fp32 master weight, and
    Adam's `exp_avg`, `exp_avg_sq` (same shard) and `step` (a scalar) for it; the LR
    schedule, the step counter and the dataloader state hold no tensors. A shard is what
    FSDP (over dp_shard x cp, rows padded to a multiple, so the first ranks hold the
    ceiling) and TP (torchtitan's llama3 plan: column-parallel weights split their rows,
    row-parallel ones their columns; norms are replicated) leave on the rank; dp_replicate
    copies it."""
    m = run.model
    fsdp, tp = degrees["dp_shard"] * degrees["cp"], degrees["tp"]
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim

    def local(rows: int, cols: int = 1, tp_dim: int | None = None) -> int:
        if tp_dim == 0:
            rows = _ceil_div(rows, tp)
        elif tp_dim == 1:
            cols = _ceil_div(cols, tp)
        return _ceil_div(rows, fsdp) * cols

    per_layer = [
        local(q, m.dim, 0),  # wq (column-parallel)
        local(kv, m.dim, 0),  # wk
        local(kv, m.dim, 0),  # wv
        local(m.dim, q, 1),  # wo (row-parallel)
        local(m.ffn_hidden_dim, m.dim, 0),  # w1
        local(m.ffn_hidden_dim, m.dim, 0),  # w3
        local(m.dim, m.ffn_hidden_dim, 1),  # w2
        local(m.dim),  # attention_norm
        local(m.dim),  # ffn_norm
    ]
    root = [local(m.vocab_size, m.dim, 0), local(m.dim)]  # tok_embeddings, norm
    if not m.weight_tying:
        root.append(local(m.vocab_size, m.dim, 0))  # lm_head
    shards = per_layer * m.n_layers + root
    element_bytes = MASTER_WEIGHT_BYTES * (1 + ADAM_MOMENTS)
    return StagedStateDict(
        tensors=TENSORS_PER_PARAMETER * len(shards),
        bytes=sum(shards) * element_bytes + len(shards) * ADAM_STEP_BYTES,
    )


GRADIENT_BYTES = 4  # an fp32 gradient per master-weight element (with its 12 staged bytes)
REPLICA_BUCKET_BYTES = 32 << 20  # a replica group's cross-group gradient bucket
REPLICA_BUCKETS_IN_FLIGHT = 2  # (`train.replica_groups.trainer.GradientSum`)
GPU_ENV = "TRAIN_GPU"  # the launch's GPU kind (scripts/slurm/submit.py --gpu), a planner row


def state_floor(run: RunConfig, degrees: dict) -> int:
    """A rank's model state at `degrees`: master weights, Adam's moments (what a save
    stages, `staged_state_dict`) and the gradients; no activations. A replica group's
    cross-group sum adds its buckets in flight, not a copy of the gradient shard
    (`train.replica_groups.trainer.GradientSum`)."""
    staged = staged_state_dict(run, degrees)
    buckets = REPLICA_BUCKET_BYTES * REPLICA_BUCKETS_IN_FLIGHT if run.replica_groups.groups else 0
    return staged.bytes + staged.bytes * GRADIENT_BYTES // 12 + buckets


def check_gpu_memory(run: RunConfig, degrees: dict, gpu: str | None) -> None:
    """Refuse (ConfigError, one line) a layout whose model state alone (`state_floor`)
    exceeds the memory of a `gpu` (a planner row, `train.plan.gpu_specs`; None: not
    checked), naming the fewest ranks of the same tp, cp and dp_replicate whose state fits.
    Such a layout cannot train at all; whether one that passes fits with its activations
    and the allocator's share is the dry run's verdict (`python -m train --dry-run`)."""
    if not gpu:
        return
    from train.plan.gpu_specs import gpu_spec

    spec = gpu_spec(gpu, run)  # and the FP8 settings that GPU cannot train
    usable = spec.memory_gib * GIB
    floor = state_floor(run, degrees)
    if floor <= usable:
        return
    world = degrees["tp"] * degrees["cp"] * degrees["dp_replicate"] * degrees["dp_shard"]
    groups = run.replica_groups.groups
    fix = f"no world size up to {MAX_RANKS} holds it: raise tp"
    for _, ranks, at in larger_launches(run, world):
        if at <= usable:
            fix = f"{ranks} ranks{' a group' if groups else ''} hold it ({at / GIB:.1f} GiB a rank): give more nodes"
            break
    extra = ", the replica groups' gradient buckets" if groups else ""
    raise ConfigError(
        f"a rank's model state alone (fp32 weights, gradients, Adam's moments{extra}) is "
        f"{floor / GIB:.1f} GiB on {world} ranks{' a group' if groups else ''} (tp "
        f"{degrees['tp']}, dp_shard {degrees['dp_shard']}, cp {degrees['cp']}), but one {spec.name} "
        f"({gpu}) has {usable / GIB:.0f} GiB; at this tp and cp {fix}"
    )


MAX_RANKS = 16384  # the search for a world size that holds the state goes this far


def larger_launches(run: RunConfig, world_size: int) -> Iterator[tuple[RunConfig, int, int]]:
    """(`run` with dp_shard the rest, a world size, `state_floor` there) for each world size
    above `world_size` up to `MAX_RANKS` that the launch rules admit with `run`'s tp, cp and
    dp_replicate, fewest ranks first: more ranks shard only the model state."""
    p = run.parallelism
    others = p.dp_replicate * p.tp * p.cp
    search = replace(run, parallelism=replace(p, dp_shard=-1))
    for ranks in range(others * (world_size // others + 1), MAX_RANKS + 1, others):
        try:
            degrees = check_launch(search, ranks)
        except ConfigError:
            continue
        yield search, ranks, state_floor(search, degrees)


def raise_open_file_limit() -> int:
    """Raise this process's soft `nofile` limit to its hard limit (children, the DCP
    daemon included, inherit it); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def local_ranks(world_size: int) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE in a worker; in `--check`, the
    SLURM launcher's TRAIN_NPROC_PER_NODE, else all of `world_size` (scripts/train_local.sh
    runs one node)."""
    for name in ("LOCAL_WORLD_SIZE", "TRAIN_NPROC_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return min(int(value), world_size)
    return world_size


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_available() -> int | None:
    """Memory this container may still use (cgroup v2, else v1); None if unlimited."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes a huge number for none
            return None
        return max(0, int(limit) - usage)
    return None


def available_memory() -> int | None:
    """Host RAM this process's node may still use: MemAvailable, or the container's
    cgroup allowance if smaller (a container's /proc/meminfo shows the whole host)."""
    known = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    return min(known) if known else None


def shm_free() -> int | None:
    """Free bytes in /dev/shm, or None where there is none."""
    try:
        return shutil.disk_usage(SHM).free
    except OSError:
        return None


def check_host(run: RunConfig, degrees: dict[str, int]) -> None:
    """Raise the soft open-file limit, then refuse (ConfigError, one line naming the fix) a
    host that cannot hold what the configured async checkpoint stages (module docstring)."""
    open_files = raise_open_file_limit()
    if not run.checkpoint.enable:
        return
    mode = resolve_async_checkpoint(run.checkpoint.async_mode)
    if mode == "disabled":
        return  # nothing is staged: DCP writes from the training tensors
    world_size = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"] * degrees["cp"]
    staged = staged_state_dict(run, degrees)
    ranks = local_ranks(world_size)
    node_bytes = staged.bytes * ranks
    key = f"checkpoint.async_mode = {mode!r}"
    per_node = (
        f"{staged.bytes / GIB:.2f} GiB per rank, {node_bytes / GIB:.2f} GiB for this node's "
        f"{ranks} rank(s)"
    )
    if mode == PINNED:
        needed = 2 * staged.tensors + OTHER_OPEN_FILES + world_size
        if needed > open_files:
            raise ConfigError(
                f"{key} keeps {staged.tensors:,} state-dict tensors per rank in shared "
                "memory, an open file each (twice that while a save goes to DCP's daemon): "
                f"{needed:,} open files with the rest of the process, but the hard limit "
                f"(ulimit -Hn) is {open_files:,}; raise it (ulimit -n, limits.conf, docker run "
                "--ulimit nofile=1048576:1048576) or set checkpoint.async_mode = 'async' "
                "(ordinary memory, no open files)"
            )
        free = shm_free()
        if free is not None and node_bytes > free:
            raise ConfigError(
                f"{key} stages the checkpoint in /dev/shm, {per_node}, but /dev/shm has "
                f"{free / GIB:.2f} GiB free; give it more (docker run --shm-size, or a larger "
                "tmpfs) or set checkpoint.async_mode = 'async' (ordinary memory)"
            )
    memory = available_memory()
    if memory is not None and node_bytes > memory:
        what = "pinned host RAM" if mode == PINNED else "host RAM during each save"
        raise ConfigError(
            f"{key} stages the checkpoint in {what}, {per_node}, but {memory / GIB:.2f} GiB "
            "is available (MemAvailable, or the container's memory limit); use more nodes "
            "(a rank's share shrinks with the FSDP degree) or set "
            "checkpoint.async_mode = 'disabled'"
        )
