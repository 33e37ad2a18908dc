"""What each rank prints: rank 0 tells the story, the others speak only when something breaks.

Why: every rank of a torchrun job writes to the same console (or the same SLURM log). With
each rank logging every step, 2 processes print every line twice and a 64-GPU job 64 times,
which buries the one line that matters. torchtitan's own launcher filters to rank 0
(`--local-ranks-filter`), but that also hides another rank's traceback. So, in-process:

- rank 0 logs at INFO, as torchtitan formats it;
- other ranks log only ERROR and above, and Python warnings (identical on every rank) are
  left to rank 0;
- in a multi-rank job every line carries its rank (`[rank3]`), so an error says who failed.

`TRAIN_LOG_RANKS=all` (or a comma list, e.g. `0,5`) shows INFO lines from those ranks too.

Known noise: lines the installed libraries print on every run that look like faults and are
not (`common.noise.KNOWN_NOISE`, each with why it is harmless) are dropped where they are raised: a filter
on the logger that emits them, or a `warnings` filter for the message. `TRAIN_LOG_NOISE=1`
shows them all again. tests/train/test_console.py checks that each text still occurs in the
installed library's source (so an upgrade that rewords one fails there, naming it) and that
a run's console holds none of them, unless the switch is on.
"""

from __future__ import annotations

import logging
import os
import warnings

from common.noise import filter_known_noise

LOG_RANKS_ENV = "TRAIN_LOG_RANKS"


def ranks_shown(spec: str | None, world_size: int) -> set[int]:
    """The ranks whose INFO lines are shown, from TRAIN_LOG_RANKS ("all", "0,3"; default "0")."""
    spec = (spec or "0").strip()
    if spec == "all":
        return set(range(world_size))
    try:
        ranks = {int(part) for part in spec.split(",") if part.strip()}
    except ValueError:
        raise ValueError(
            f"{LOG_RANKS_ENV}={spec!r}: expected 'all' or a comma-separated list of ranks, "
            "e.g. TRAIN_LOG_RANKS=0,3"
        ) from None
    return ranks


def is_shown(rank: int, world_size: int) -> bool:
    return rank in ranks_shown(os.environ.get(LOG_RANKS_ENV), world_size)


def quiet_console(rank: int, world_size: int) -> None:
    """Before torch is imported: drop the known noise, and a rank whose INFO lines are hidden
    also drops the other warnings every rank would repeat (torch deprecations)."""
    filter_known_noise()
    if not is_shown(rank, world_size):
        logging.disable(logging.WARNING)
        warnings.filterwarnings("ignore")


def configure_console(rank: int, world_size: int) -> None:
    """Install torchtitan's console logger, filtered and tagged for this rank."""
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    shown = is_shown(rank, world_size)
    tag = f"[rank{rank}] " if world_size > 1 else ""
    formatter = logging.Formatter(f"[titan] {tag}%(asctime)s - %(levelname)s - %(message)s")
    for handler in logger.handlers:
        handler.setFormatter(formatter)
        handler.setLevel(logging.INFO if shown else logging.ERROR)
