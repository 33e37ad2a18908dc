"""Independent one-process CPU work (plans, traces) side by side on the machine's cores.

Why: a plan or a trace is one single-threaded process's work (the suite runs with
OMP_NUM_THREADS=1), and the tests that need several of them would otherwise leave a core
idle; on the project's 2-core machines two at once take about half the wall time. Workers
are spawned (a fresh interpreter each, nothing inherited from the test process's torch
state) and prepare the runtime first, as `python -m train --dry-run` does before planning.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from train.runtime import prepare_runtime

Call = tuple[Callable[..., Any], tuple, dict]


def _call(call: Call) -> Any:
    fn, args, kwargs = call
    return fn(*args, **kwargs)


def side_by_side(calls: Sequence[Call], workers: int | None = None) -> list[Any]:
    """Each `(fn, args, kwargs)` run in one of `workers` spawned processes (default: the
    cores, at most one per call); the results in the calls' order. `fn` must be importable
    by name (a module-level function), and its arguments and result picklable."""
    workers = max(1, min(workers or os.cpu_count() or 1, len(calls)))
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=spawn, initializer=prepare_runtime) as pool:
        return list(pool.map(_call, calls))
