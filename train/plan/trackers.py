"""How the planner counts a traced step: torch's memory tracker and our dispatch counter.

Why apart from the tracer: building the trainer a launch builds (`train.plan.trace`) and
counting what its step does are two jobs; the counting leans on torch internals (a dispatch
mode under DTensor, MemTracker, ModTracker, DTensor's sharding propagator), each listed in
tests/test_private_api.py, and is best read in one place.

How (rank 0, one phase at a time):
- memory: torch's `MemTracker` measures every allocation (`mem_tracker`), with DTensor's
  global-shape propagation skipped (`sharding_propagation_not_counted`) and lm_head allowed
  to run once per loss chunk;
- everything else: `step_counter`, a dispatch mode that sees every op below DTensor and the
  FP8 tensor subclasses and counts GEMM FLOPs by dtype (torch's formulas; FP8 apart, rowwise
  apart), attention FLOPs as the causal kernel executes them (`train.plan.step_counts.
  attention_flops`), the bytes every other non-view op reads and writes (the FP8 casts apart:
  ops inside a Float8Linear, found by torch's ModTracker; and torchao's compiled figure for
  them at each forward FP8 GEMM), and the bytes and calls of every collective by mesh
  dimension (`mesh_groups`: the group's ranks say which links it crosses);
- the checkpointer's cache: what a state dict allocates beyond the parameters' storage, by
  storage identity (`fresh_bytes`), which fake tensors keep.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from train.plan.step_counts import OpCounts, attention_flops, fp8_cast_bytes

_PROPAGATING = [0]


class _ShardingPropagation:
    """Stands in for DTensor's `ShardingPropagator._fake_mode_lock`, which wraps exactly the
    fake run of an op at *global* shape that DTensor makes to learn its output's metadata.
    Under our FakeTensorMode that run would be counted as memory and FLOPs; the trackers
    skip ops while it is entered."""

    def __enter__(self) -> None:
        _PROPAGATING[0] += 1

    def __exit__(self, *exc: object) -> None:
        _PROPAGATING[0] -= 1


@contextlib.contextmanager
def sharding_propagation_not_counted() -> Iterator[None]:
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    previous = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = _ShardingPropagation()
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = previous


def mem_tracker() -> Any:
    """torch's MemTracker, with two accommodations for torchtitan's step: DTensor's shape
    propagation is skipped (see `_ShardingPropagation`), and a module called again in one
    forward (the chunked loss calls lm_head once per chunk) keeps its first call's stats
    instead of raising "multiple iterative calls" (only the per-module table is affected;
    every allocation is still counted)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import DTensor

    class StepMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                return
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state):
            # after every op: the step's peak only, as torch's keeps it per device; torch's
            # also walks every tracked module's stats, a fifth of a trace's time, for a
            # per-module table the plan never reads
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _PROPAGATING[0] and not any(t is DTensor for t in types):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def peak_bytes(self) -> int:
            return sum(snap["Total"] for snap in self.get_tracker_snapshot("peak").values())

    return StepMemTracker()


class NoTracker(contextlib.nullcontext):
    """MemTracker's interface, measuring nothing."""

    def track_external(self, *tensors: Any) -> None:
        pass

    def peak_bytes(self) -> int:
        return 0


# an op's name (underscores dropped: `all_gather_into_tensor`, `_allgather_base`) -> kind
_COLLECTIVES = {
    "allgather": "all-gather",
    "reducescatter": "reduce-scatter",
    "allreduce": "all-reduce",
    "alltoall": "all-to-all",
    "broadcast": "broadcast",
}
# context parallelism's K/V exchange: one custom op each way, its collectives run inside it
_CP_OPS = {"flex_cp_allgather": "all-gather", "flex_cp_allgather_backward": "reduce-scatter"}
_ATTENTION_FORWARD = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "flex_attention",
)


def _collective_kind(namespace: str, name: str) -> str | None:
    """FSDP2's collectives reach c10d ops; DTensor's (TP/SP redistributions, loss
    parallel, the gradient-norm reduction) and torchao's amax reductions stay functional
    collectives; CP's K/V exchange is `cplib`. Other namespaces are local ops."""
    if namespace == "cplib":
        return _CP_OPS.get(name)
    if namespace not in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
        return None
    bare = name.replace("_", "")
    return next((kind for op, kind in _COLLECTIVES.items() if bare.startswith(op)), None)


def mesh_groups(parallel_dims: Any) -> dict[str, tuple[str, list[int]]]:
    """Process-group name -> (mesh dimension, rank 0's group ranks), the model-parallel
    dimensions first where several share a group."""
    import torch.distributed as dist

    groups: dict[str, tuple[str, list[int]]] = {}
    for dim in ("tp", "cp", "dp_replicate", "fsdp", "dp_shard", "batch", "loss"):
        try:
            mesh = parallel_dims.get_optional_mesh(dim)
        except ValueError:  # a dimension this SPMD backend's meshes do not have
            continue
        if mesh is not None:
            group = mesh.get_group()
            groups.setdefault(group.group_name, (dim, dist.get_process_group_ranks(group)))
    world = dist.group.WORLD
    groups.setdefault(world.group_name, ("world", dist.get_process_group_ranks(world)))
    return groups


def step_counter(
    groups: dict[str, tuple[str, list[int]]], fp8_recipe: str, weight_cast_share: float = 1.0
) -> Any:
    """FLOPs, memory-bound bytes and collectives of every op that runs (module doc).

    Memory-bound bytes come in three classes: "eager fp8 casts" (ops run inside a
    Float8Linear's forward or backward: the amax, scale and cast kernels of its operands),
    "eager other" (everything else), and "compiled fp8 casts" (what torchao's roofline
    model says compiled code moves for the same casts, `fp8_cast_bytes`, counted at each
    forward FP8 GEMM, recompute included, the weight's at `weight_cast_share`: a shard's
    under the FP8 all-gather); the time model takes the compiled class in place of the
    eager one for compiled runs."""
    import torch
    import torch.distributed as dist
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    plain = (torch.Tensor, torch.nn.Parameter, FakeTensor)
    gemms = {
        torch.ops.aten.mm,
        torch.ops.aten.addmm,
        torch.ops.aten.bmm,
        torch.ops.aten.baddbmm,
        torch.ops.aten._scaled_mm,
    }

    def group_of(args, kwargs) -> tuple[str, list[int]]:
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, str) and a in groups:
                return groups[a]
            if isinstance(a, torch.ScriptObject):
                pg = dist.ProcessGroup.unbox(a)
                return groups.get(pg.group_name, ("fsdp", dist.get_process_group_ranks(pg)))
        return groups[dist.group.WORLD.group_name]

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    class StepCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.phases = {"micro": OpCounts(), "once": OpCounts()}
            self.phase = "micro"
            self.used: dict[str, list[int]] = {}  # mesh dimension -> ranks, as met
            self._open: list[bool] = []  # collectives being run: did one run inside?
            # inside a Float8Linear: [forward (and its recompute), backward]
            self._fp8 = [0, 0]
            self._modules = ModTracker()

            def marker(index: int, step: int):
                def hook(module, *_):
                    if module is not None and type(module).__name__ == "Float8Linear":
                        self._fp8[index] += step

                return hook

            self._modules.register_user_hooks(
                marker(0, 1), marker(0, -1), marker(1, 1), marker(1, -1)
            )

        def __enter__(self):
            self._modules.__enter__()
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            self._modules.__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t not in plain for t in types):
                return NotImplemented  # count the local ops of DTensor and FP8 subclasses
            kwargs = kwargs or {}
            packet = func._overloadpacket
            kind = _collective_kind(func.namespace, packet.__name__)
            if kind is not None:
                self._open.append(False)
            out = func(*args, **kwargs)
            if kind is not None:
                ran_inner = self._open.pop()
                if self._open:
                    self._open[-1] = True
            if _PROPAGATING[0]:
                return out
            counts = self.phases[self.phase]
            if kind is not None:
                # FSDP2's all-gather is a functional collective that runs the c10d one
                # inside, CP's custom op runs two: count the outermost once
                if not ran_inner or func.namespace == "cplib":
                    self.count_collective(counts, func, kind, args, kwargs, out)
                return out
            name = packet.__name__
            if name in _ATTENTION_FORWARD or name.removesuffix("_backward") in _ATTENTION_FORWARD:
                q, k = args[0], args[1]
                if name.endswith("_backward"):  # (grad_out, q, k, v, ...)
                    q, k = args[1], args[2]
                b, h, lq, d = q.shape
                counts.add(
                    "flops",
                    "attention",
                    attention_flops(b, h, lq, k.shape[2], d, backward=name.endswith("_backward")),
                )
            elif packet in gemms:
                dtype = str(args[0].dtype).removeprefix("torch.")
                key = f"gemm {dtype}"
                if "float8" in dtype:  # scales per row (rowwise) run other kernels
                    dtype, key = "float8", "gemm float8" + " rowwise" * (args[2].numel() > 1)
                counts.add("flops", key, flop_registry[packet](*args, **kwargs, out_val=out))
                if dtype == "float8" and self._fp8[0] and not self._fp8[1] and fp8_recipe:
                    m, k = args[0].shape[-2:]
                    counts.add("memory_bytes", "compiled fp8 casts",
                               fp8_cast_bytes(fp8_recipe, m, k, args[1].shape[-1],
                                              weight_cast_share))  # fmt: skip
            elif (
                # metadata (prim.device: fake tensors only), collective plumbing (waits, wraps)
                func.namespace
                not in ("prim", "c10d", "_c10d_functional", "_c10d_functional_autograd")
                and not _is_view(func)
                and not name.startswith("empty")
            ):
                seen = {
                    id(t): nbytes(t)
                    for t in pytree.tree_leaves((args, kwargs, out))
                    if isinstance(t, torch.Tensor)
                }
                if seen:
                    kind = "eager fp8 casts" if any(self._fp8) else "eager other"
                    counts.add("memory_bytes", kind, sum(seen.values()))
            return out

        def count_collective(self, counts, func, kind, args, kwargs, out) -> None:
            mesh, ranks = group_of(args, kwargs)
            self.used[mesh] = ranks
            tensors = [
                t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
            ]
            if not tensors:
                return
            if func.namespace == "cplib":  # K and V at once: gathered, or their gradients reduced
                moved = out if kind == "all-gather" else args[:2]
                size, dtype = sum(nbytes(t) for t in moved), moved[0].dtype
                kind = f"{kind} (K, V)"
            else:
                biggest = max(tensors, key=nbytes)
                size, dtype = nbytes(biggest), biggest.dtype
            key = f"{mesh} {kind} {str(dtype).removeprefix('torch.')}"
            counts.add("comm", key, size)
            counts.add("comm_calls", key, 1)

    return StepCounter()


def _is_view(func) -> bool:
    """An op whose output aliases its input without writing it: no memory traffic."""
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def local_tensor(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in map(local_tensor, tensors))


def storages(t: Any) -> Iterator[tuple[Any, int]]:
    """(storage, bytes) of the plain tensors under `t`: a DTensor's local shard, and the
    inner tensors of a wrapper subclass (torchao's FP8 weight wraps the bf16/fp32 one)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    t = local_tensor(t)
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from storages(getattr(t, name))
        return
    yield StorageWeakRef(t.untyped_storage()), t.numel() * t.element_size()


def fresh_bytes(tensors: Any, owned: set) -> int:
    """Bytes of the tensors whose storage is none of `owned` (storage identity, which fake
    tensors keep: a view of a parameter shares its storage)."""
    total, seen = 0, set(owned)
    for t in tensors:
        for ref, size in storages(t):
            if ref not in seen:
                seen.add(ref)
                total += size
    return total
