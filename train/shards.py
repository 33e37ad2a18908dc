"""This rank's piece of a tensor: the one DTensor helper the per-rank checks share.

Why a module of its own: the non-finite check (`train.reliability.health`) and the FP8 telemetry
(`train.components.fp8_stats`) both read what this rank holds of a parameter, a gradient or an
activation, never the global tensor (that would gather it). Each feature importing it from
the other would make one depend on the other; both import it from here.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
