"""Run a module of ours on an older torch than the pin: the gaps torchtitan 0.3.0 meets on
torch 2.11 (the leased GPU machine's image), filled for the GPU check only.

Why it exists: the project pins torch 2.13.0, and torchtitan 0.3.0 calls two APIs that
torch 2.11 lacks. The leased machine's image has torch 2.11.0+cu130 and no package registry,
and a CUDA torch wheel is ~1 GB against a 64 MiB carry limit, so the check cannot bring the
pinned torch along. Rather than report "does not import" and learn nothing about the GPU
path, the check runs our trainer through this bridge, and the report names every gap it
filled (`apply()` returns them), so no number is mistaken for one taken on the pinned stack.

Each gap, what fills it, and why the filling is exact where it is used:
1. `torch.distributed.fsdp.DataParallelMeshDims` (new in 2.13) is imported at module level
   by `torchtitan/distributed/fsdp.py`; a stand-in class makes the import succeed.
   It is only *passed* to `fully_shard` under `spmd_backend` full_dtensor/spmd_types, so the
   check runs `partial_dtensor` (what a multi-rank launch picks anyway), where torchtitan
   passes nothing and FSDP2 is torch 2.11's own.
2. `create_block_mask(..., separate_full_blocks=...)` (new in 2.13): torchtitan passes
   True outside batch-invariant mode, which is what torch 2.11 always does; the wrapper
   drops the argument when True and refuses False.
3. torchtitan's `ChunkedLossWrapper` runs one backward per chunk inside the forward; under
   FSDP2 on torch 2.11 that backward's end-of-backward callback reshards the decoder, whose
   own backward then reads saved weights with no storage ("The tensor has a non-zero
   number of elements, but its data is not allocated yet" on CUDA, a segfault on CPU; seen
   on the leased H100, 2026-11-26, and on CPU with 2 gloo ranks). The trainer's config gets
   torchtitan's plain `CrossEntropyLoss` on the whole logits instead (the loss torchtitan
   trained with before the wrapper, and the one the planner's calibration rows trace); the
   check's prediction is planned with the same loss (`prepare.plan_step`).
4. torchao 0.18's C++ extensions are built against torch 2.13; loading them into another
   torch risks an ABI crash at import. Float8 training needs none of them (its GEMMs are
   `torch._scaled_mm`), so they are skipped with torchao's own switch.

Retire this file when the leased machine's image carries torch >= 2.13 (the check then reports no
bridged gaps: `python scripts/gpu_check run` says so in its environment part).

Usage: `python scripts/gpu_check/torch_bridge.py -m train --config ...` (runpy, like -m).
"""

from __future__ import annotations

import functools
import inspect
import runpy
import sys

_FILLED: list[str] = []


def apply() -> list[str]:
    """Fill the gaps this torch has; returns what was filled (empty on torch >= 2.13)."""
    if _FILLED:
        return list(_FILLED)
    import os

    import torch

    older = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
    if older:
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
        _FILLED.append("torchao's C++ extensions not loaded (built for torch 2.13)")
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex

    if not hasattr(fsdp, "DataParallelMeshDims"):  # a stand-in: imported, never passed
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
        _FILLED.append("torch.distributed.fsdp.DataParallelMeshDims (stand-in; partial_dtensor)")

    if "separate_full_blocks" not in inspect.signature(flex.create_block_mask).parameters:
        original = flex.create_block_mask

        @functools.wraps(original)
        def create_block_mask(*args, separate_full_blocks: bool = True, **kwargs):
            if not separate_full_blocks:
                raise NotImplementedError("separate_full_blocks=False needs torch >= 2.13")
            return original(*args, **kwargs)

        flex.create_block_mask = create_block_mask
        _FILLED.append("create_block_mask(separate_full_blocks=True) dropped (2.11's behaviour)")
    if older:
        import train.build

        chunked_config = train.build.to_trainer_config

        @functools.wraps(chunked_config)
        def to_trainer_config(run, *args, **kwargs):
            from torchtitan.components.loss import CrossEntropyLoss

            config = chunked_config(run, *args, **kwargs)
            config.loss = CrossEntropyLoss.Config(global_vocab_size=run.model.vocab_size)
            return config

        train.build.to_trainer_config = to_trainer_config
        _FILLED.append(FULL_LOGITS_LOSS)
    return list(_FILLED)


FULL_LOGITS_LOSS = "full-logits CrossEntropyLoss for ChunkedLossWrapper (its FSDP2 backward)"


def trains_full_logits() -> bool:
    """Whether this torch trains with the full-logits loss (gap 3)."""
    return FULL_LOGITS_LOSS in apply()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "-m":
        sys.exit("usage: torch_bridge.py -m MODULE [ARGS...]")
    apply()
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
