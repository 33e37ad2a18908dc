"""The exit codes of our commands: one table, read by every entry point, launcher and doc.

Why one table: an exit code is an interface. `scripts/slurm/torchrun.py` decides from it
whether torchrun's traceback is noise, `train.sbatch` whether a failed attempt may be
requeued, a test what a run did. When each number lived beside the code that first used it
(a user error in `common/io.py`, a hang in `train/reliability/watchdog.py`, a diverged run in
`train/reliability/health.py`), a new one could collide with an old one and nobody reading one file
saw the others. The numbers themselves never change: scripts and clusters already read them.

| code | name | who exits with it |
| --- | --- | --- |
| 0 | `OK` | success; also a preempted run that checkpointed (`RUN/preempted.json` says so) |
| 1 | `FAILED` | a command that ran and found a fault: a `--dry-run` plan that does not fit, an export whose held-out loss through the server is off, `eval.watch --once` with a failed step. Also Python's own code for a crash (an uncaught exception), and torchrun's for any worker failure but a user error |
| 2 | `USER_ERROR` | bad input: a flag, file, key or value, reported as one line `error: ...` (`common.io.run_cli`) |
| 3 | `HANG` | the training watchdog found a rank that stopped making progress (`train.reliability.watchdog`) |
| 4 | `DIVERGED` | training stopped itself: too many non-finite steps, a loss spike past `health.max_rollbacks`, or a loss jump after a resume in another FP8 format (`RUN/diverged.json`) |

Under torchrun a worker's 3 or 4 becomes the launcher's 1 (only a user error's 2 is passed
on, by `scripts/slurm/torchrun.py`); the files each one writes (`RUN/hang/hang.json`,
`RUN/diverged.json`) are what `train.sbatch` reads to tell them apart. Shell scripts cannot
import this module: a script that exits with a number of its own points here in its header
comment, and tests/common/test_exit_codes.py holds every such number to this table.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """A process exit status of ours; an `int`, so `sys.exit` and `os._exit` take it."""

    OK = 0
    FAILED = 1
    USER_ERROR = 2
    HANG = 3
    DIVERGED = 4
