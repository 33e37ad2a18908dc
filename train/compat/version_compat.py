"""What torch 2.13.0 lacks but torchtitan 0.3.0 calls: filled in on every device.

Why apart from `train.compat.cpu_compat`: that module holds only what differs without an
accelerator. A version gap hits a GPU run just the same, so it must never hide behind a
device check (it once did, and every GPU run would have died after step 1).

- `torch.distributed.set_timeout`: torchtitan calls it after the first step to switch from
  the init timeout to the training timeout (`torchtitan/distributed/utils.py`); torch
  2.13 (CPU and CUDA builds) only has the private `distributed_c10d._set_pg_timeout`,
  which takes the same (timeout, group) arguments.
"""

from __future__ import annotations

import torch


def apply() -> None:
    """Fill the version gaps; idempotent, device-independent."""
    if not hasattr(torch.distributed, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        torch.distributed.set_timeout = _set_pg_timeout
