#!/usr/bin/env python3
"""torchrun, minus its traceback when the workers stopped on a user error.

    torchrun.py [torchrun arguments] -m train --config CONFIG ...

Why: `python -m train` reports a bad config, bad data or a GPU it cannot use as one line
`error: ...` and exit code 2 (`common.exit_codes.ExitCode.USER_ERROR`). torchrun then adds a
logged "failed (exitcode: 2)" line and a 40-line `ChildFailedError` traceback, which buries
that line. Here torchrun (`torch.distributed.run.main`, what the `torchrun` command calls)
runs as it is; only when the first worker to fail exited with the user-error code are its
traceback and its log lines dropped, and the launcher exits 2 too. Any other failure (a
crash, a signal, a hang) keeps torchrun's full report and exit code.

This process is the torchrun agent, and the launchers `exec` it (train_local.sh,
torchrun_node.sh): the launcher's death is the agent's. It tells its workers its PID
(TRAIN_AGENT_PID), so that a worker whose agent died before the worker could watch it
still knows (common/process.py `follow_launcher`: torchrun starts workers in sessions of
their own, so nothing else ends them with the launcher).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record  # noqa: E402
from torch.distributed.run import main as torchrun_main  # noqa: E402

from common.exit_codes import ExitCode  # noqa: E402
from common.process import AGENT_PID_ENV  # noqa: E402


def _not_user_error_exit(record: logging.LogRecord) -> bool:
    """Log filter: drops torchrun's "failed (exitcode: 2) local_rank: ..."; the worker said why."""
    return not (
        str(record.msg).startswith("failed (exitcode: ")
        and bool(record.args)
        and record.args[0] == ExitCode.USER_ERROR
    )


def main() -> int:
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the workers inherit it
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        _not_user_error_exit
    )
    try:
        # torchrun's main without its @record, whose handling of a worker's error file
        # would log one more line for a user error (torchtitan's Trainer, @record too,
        # writes that file on the way to our one-line handler)
        torchrun_main.__wrapped__(sys.argv[1:])
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        if first.exitcode == ExitCode.USER_ERROR:
            return ExitCode.USER_ERROR
        record(_reraise)(e)  # any other failure: exactly torchrun's report
    return 0


def _reraise(error: BaseException) -> None:
    raise error


if __name__ == "__main__":
    sys.exit(main())
