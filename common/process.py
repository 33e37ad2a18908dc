"""Process lifetimes: whether a process still runs, where a PID means something, and a
process that ends with its parent. One home for what the run lease, the watchdog, the
checkpoint daemon, the launchers and the export's temp-folder cleanup all ask.

- `process_alive(pid, start_ticks)`: the process runs and is the one that started at
  `start_ticks` (a reused PID is not), from /proc (signal 0 where there is none);
  `process_start_ticks` reads that start time, `machine_identity` says where a PID check
  means anything (host name, boot id, PID namespace). The run lease (`common.run_lease`)
  judges a holder on this machine with them; `eval.export` removes a dead export's temp
  folder with `process_alive`.
- `follow_parent`: call a function (default: exit at once) as soon as this process's parent
  is gone. The async checkpoint daemon follows its worker with it
  (`train.components.dcp_workarounds`).
- `follow_launcher`: a torchrun worker ends when its launcher does, from start-up
  (`python -m train`): torchrun starts each worker in a session of its own, so `kill -9` of
  the launcher's process group, the out-of-memory killer taking the torchrun agent, or a
  closed terminal used to leave the workers training on, reparented to init, beside the
  next launch on the same run folder. `scripts/slurm/torchrun.py` names the agent to its
  workers in `AGENT_PID_ENV`.

Standard library only, like the rest of `common`: the launchers' helpers import it without
torch.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from common.exit_codes import ExitCode

AGENT_PID_ENV = "TRAIN_AGENT_PID"
"""Set by scripts/slurm/torchrun.py to the torchrun agent's PID, for its workers."""


def machine_identity() -> str:
    """Host name, boot id and PID namespace: two processes see each other's PIDs only when
    all three agree (a container with the host's name but its own PID namespace, or the
    same host after a reboot, does not)."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        parts.append("")
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("")
    return "|".join(parts)


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def process_start_ticks(pid: int) -> int | None:
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def process_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether process `pid` on this machine is running and is the one that started at
    `start_ticks` (not a later process given the same PID)."""
    fields = _proc_stat(pid)
    if fields is None:
        if Path("/proc/self/stat").exists():
            return False  # Linux, and no such process
        try:  # no /proc: signal 0 only says whether the PID exists
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] in ("Z", "X"):  # a zombie has finished: nothing of it still runs
        return False
    return start_ticks is None or int(fields[19]) == start_ticks


_PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal to get when the parent thread exits
_PARENT_DEATH_SIGNAL = signal.SIGUSR2


def launcher_pid() -> int | None:
    """The torchrun agent that started this worker, or None when this process is not a
    torchrun worker (a plain `python -m train` belongs to no launcher: it may outlive its
    shell under nohup). The agent's own word (TRAIN_AGENT_PID, set by our torchrun.py)
    closes the window between this process's start and its first check: a named agent
    that is gone is returned, and the first check exits. Else this process's parent at
    the time of asking (a plain torchrun, or a TRAIN_AGENT_PID inherited from elsewhere
    that names another live process)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    named = os.environ.get(AGENT_PID_ENV, "")
    if named.isdigit() and not process_alive(int(named), None):
        return int(named)
    return os.getppid()


def follow_launcher(poll_s: float = 1.0) -> None:
    """End this torchrun worker, in one line, within about `poll_s` of its agent's death.

    The torchrun agent is the launcher process itself (train_local.sh and torchrun_node.sh
    `exec` it), so the agent's death is the launcher's; and the worker's checkpoint daemon
    follows the worker (`follow_parent`, from train/components/checkpoint.py), so the chain
    ends whole. Call from the main thread (signal handlers can only be installed there).
    """
    agent = launcher_pid()
    if agent is not None:
        follow_parent(agent, _launcher_gone, poll_s)


def follow_parent(
    parent: int | None = None, gone: Callable[[int], object] | None = None, poll_s: float = 1.0
) -> None:
    """Call `gone(parent)` (default: exit at once, silently) as soon as this process's
    parent is no longer `parent` (default: the parent it has now). Two ways, because each
    alone can be late:
    - the parent-death signal (prctl PR_SET_PDEATHSIG): the kernel signals this process
      when the thread that started it exits. torchrun starts its workers from its main
      thread, whose exit is the agent's; a worker starts its checkpoint daemon from
      whichever thread saves. A thread's exit alone signals too, so the handler acts
      only when the parent PID has changed. It runs when the main thread next runs Python
      code;
    - a daemon thread that compares the parent PID every `poll_s`: a main thread blocked
      in a long C call (a collective, a read from a pipe) would delay the handler.
    A parent that died before the signal was armed is caught by the check right after.
    Call from the main thread.
    """
    parent = os.getppid() if parent is None else parent

    def check(*_: object) -> None:
        if os.getppid() != parent:
            (gone or _exit_now)(parent)

    signal.signal(_PARENT_DEATH_SIGNAL, check)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(_PARENT_DEATH_SIGNAL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the thread below is enough
        pass
    check()

    def poll() -> None:
        while True:
            time.sleep(poll_s)
            check()

    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def _exit_now(_: int) -> None:
    os._exit(ExitCode.FAILED)


def _launcher_gone(agent: int) -> None:
    """One line (from local rank 0: the others say the same), then exit at once: with the
    agent gone nobody collects this process's status, and the other ranks of this node
    are ending the same way (a clean shutdown would wait on them in collectives)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(
            f"error: the launcher of this run (torchrun agent pid {agent}) is gone; "
            f"rank {os.environ.get('RANK', '?')} (pid {os.getpid()}) and the other workers "
            "of this node exit, so that no orphaned worker trains on beside a relaunch",
            file=sys.stderr,
            flush=True,
        )
    os._exit(ExitCode.FAILED)
