"""Hang watchdog: a rank that makes no step progress is dumped, named, and the job ends.

Why: in synchronous training one stuck rank stops every rank at the next collective, and
nothing says which one. The collective timeout (`[comm] train_timeout_seconds`) ends the
job eventually, but every rank then fails the same way ("timed out waiting for peers"),
with no stack of the culprit and no name. The stalled rank cannot report itself either: it
may be SIGSTOPped, swapped out, or stuck in a kernel call, and then runs no code at all.

How: every rank runs a daemon thread that
1. publishes a heartbeat (a counter, its last completed step, host, pid) to the c10d
   TCPStore every `interval` seconds. Under torchrun that store is served by the torchrun
   agent of the first node, not by a training process, so it keeps answering while any
   worker is stopped. A stopped rank's counter freezes; a rank blocked in a collective
   keeps beating (collectives release the GIL).
2. watches this rank's own progress (`progress(step)`, called by the trainer at every
   step boundary). After `hang_timeout_s` without progress (the first step after a
   (re)start gets `[comm] init_timeout_seconds` instead: compilation and lazy init) it
   reads every heartbeat twice, `2 * interval` apart, and names the culprit:
   - ranks whose counter did not move: "stopped responding" (SIGSTOP, a dead host,
     a process that no longer runs Python code);
   - else ranks whose last completed step is behind the others;
   - else every rank is alive at the same step: a collective or I/O that never returns,
     named as such (the stacks show where).
3. writes the stacks of all of this rank's threads (`faulthandler`) with that verdict to
   `RUN/hang/<time>-step<S>-rank<R>.txt`; with py-spy installed, also the stacks of a
   named culprit on the same host (py-spy can read a stopped process);
4. the lowest live rank writes `RUN/hang/hang.json` and prints one line
   `error: hang: rank R ... at step S ...` to stderr; then every detecting rank exits
   with EXIT_HANG. torchrun/srun then end the other processes, and under SLURM
   `train.sbatch` counts a crash and requeues: the run resumes from its newest checkpoint
   and the dataloader state makes the data exact-once.

Cost in normal running: one small TCPStore write per rank per interval (<= 5 s).
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from common.io import write_json_atomic, write_text_atomic
from common.run_layout import HANG_DIR

EXIT_HANG = 3
"""Exit status of a process that detected a hang (distinct from user errors, 2)."""


@dataclass
class Heartbeat:
    rank: int
    seq: int
    step: int
    host: str
    pid: int
    time: float

    @classmethod
    def parse(cls, rank: int, raw: bytes) -> Heartbeat:
        return cls(rank=rank, **json.loads(raw))


class HangWatchdog:
    def __init__(
        self,
        run_dir: Path,
        hang_timeout_s: float,
        first_step_timeout_s: float,
        rank: int,
        world_size: int,
        store=None,
        key_prefix: str = "watchdog",
    ):
        self.run_dir = Path(run_dir)
        self.started_at = time.time()
        self.hang_timeout_s = hang_timeout_s
        self.first_step_timeout_s = max(first_step_timeout_s, hang_timeout_s)
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.key_prefix = key_prefix
        self.interval = min(5.0, max(0.2, hang_timeout_s / 10))
        self.host = socket.gethostname().split(".")[0]
        self._step = 0
        self._in_save_or_validation = False
        self._first_step: int | None = None
        self._last_progress = time.monotonic()
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)

    # ---------------------------------------------------------------- trainer side
    def progress(self, step: int, step_done: bool = False) -> None:
        """Called at every step boundary, and with `step_done` when a step's compute is
        done (its checkpoint save and validation follow). Cheap: a few assignments."""
        if self._first_step is None:
            self._first_step = step
            self._thread.start()
        self._step = step
        self._in_save_or_validation = step_done
        self._last_progress = time.monotonic()

    def _where(self) -> str:
        """The step in progress as the reason names it."""
        if self._in_save_or_validation:
            return f"step {self._step} (checkpoint save or validation)"
        return f"step {self._step + 1}"

    def stop(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- thread side
    def _key(self, rank: int) -> str:
        return f"{self.key_prefix}/{rank}"

    def _beat(self) -> None:
        if self.store is None:
            return
        self._seq += 1
        record = {"seq": self._seq, "step": self._step, "host": self.host}
        record |= {"pid": os.getpid(), "time": time.time()}
        try:
            self.store.set(self._key(self.rank), json.dumps(record))
        except Exception:  # the store being gone must not kill training; detection goes on
            pass

    def _read_heartbeats(self) -> dict[int, Heartbeat]:
        beats: dict[int, Heartbeat] = {}
        if self.store is None:
            return beats
        for rank in range(self.world_size):
            try:
                if self.store.check([self._key(rank)]):
                    beats[rank] = Heartbeat.parse(rank, self.store.get(self._key(rank)))
            except Exception:
                pass
        return beats

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()
            timeout = (
                self.first_step_timeout_s if self._step == self._first_step else self.hang_timeout_s
            )
            stalled_s = time.monotonic() - self._last_progress
            if stalled_s > timeout and not self._stop.is_set():
                self._on_hang(stalled_s)
                return

    def _diagnose(self) -> tuple[list[int], str]:
        """(culprit ranks, one-line reason) from two heartbeat reads.

        The step named is the one in progress (this rank's last completed step + 1): in
        synchronous training every rank completes the same steps, and a heartbeat's own
        step may be one interval stale.
        """
        first = self._read_heartbeats()
        deadline = time.monotonic() + 2 * self.interval + 0.5
        while time.monotonic() < deadline:
            self._beat()
            time.sleep(self.interval / 2)
        second = self._read_heartbeats()
        step = self._where()
        if not second:  # no store (a world of one, or it is unreachable)
            return [self.rank], (
                f"rank {self.rank} ({self.host} pid {os.getpid()}) made no progress in "
                f"{step} (no heartbeats to compare with)"
            )
        now = time.time()
        silent = [
            r
            for r in range(self.world_size)
            if r not in second or (r in first and first[r].seq == second[r].seq)
        ]
        if silent:
            parts = []
            for r in silent:
                hb = second.get(r)
                if hb is None:
                    parts.append(f"rank {r} never sent a heartbeat")
                else:
                    parts.append(
                        f"rank {r} ({hb.host} pid {hb.pid}) stopped responding in {step} "
                        f"(no heartbeat for {now - hb.time:.0f} s)"
                    )
            return silent, "; ".join(parts)
        lowest = min(hb.step for hb in second.values())
        behind = sorted(r for r, hb in second.items() if hb.step == lowest)
        if lowest < max(hb.step for hb in second.values()):
            names = ", ".join(f"rank {r} ({second[r].host} pid {second[r].pid})" for r in behind)
            return behind, f"{names} stuck in step {lowest + 1}, behind the other ranks"
        return list(range(self.world_size)), (
            f"all {self.world_size} ranks alive but none finished {step} "
            "(a collective or I/O that never returns; compare the stacks)"
        )

    def _on_hang(self, stalled_s: float) -> None:
        culprits, reason = self._diagnose()
        step = self._step if self._in_save_or_validation else self._step + 1  # in progress
        message = (
            f"hang: {reason}; detected by rank {self.rank} after {stalled_s:.0f} s without "
            f"step progress (hang_timeout_s={self.hang_timeout_s:g}); stacks in "
            f"{self.run_dir / HANG_DIR}/"
        )
        hang_dir = self.run_dir / HANG_DIR
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        try:
            hang_dir.mkdir(parents=True, exist_ok=True)
            dump = hang_dir / f"{stamp}-step{step}-rank{self.rank}.txt"
            write_text_atomic(dump, f"{message}\n\n{self._own_stacks()}")
            self._py_spy_dumps(culprits, hang_dir, stamp, step)
            beats = self._read_heartbeats()
            live = [r for r in beats if r not in culprits] or [self.rank]
            if self.rank == min(live) and not self._reported_in_this_attempt(hang_dir):
                record = {"culprit_ranks": culprits, "step": step, "reason": reason}
                record["last_completed_step"] = self._step
                record |= {"detected_by": self.rank, "stalled_s": stalled_s, "time": time.time()}
                write_json_atomic(hang_dir / "hang.json", record)
                print(f"error: {message}", file=sys.stderr, flush=True)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_HANG)

    def _reported_in_this_attempt(self, hang_dir: Path) -> bool:
        """The first report of this attempt stands: a stopped rank that runs again after
        another rank named it (SIGCONT, or a SIGTERM it acts on late) finds the job gone
        and would otherwise replace the true diagnosis with its own "no progress"."""
        try:
            return (hang_dir / "hang.json").stat().st_mtime >= self.started_at
        except FileNotFoundError:
            return False

    def _own_stacks(self) -> str:
        names = {t.ident: t.name for t in threading.enumerate()}
        table = "\n".join(f"  thread 0x{ident:x}: {name}" for ident, name in names.items())
        with tempfile.TemporaryFile("w+") as tmp:
            faulthandler.dump_traceback(tmp, all_threads=True)
            tmp.seek(0)
            stacks = tmp.read()
        return (
            f"rank {self.rank} ({self.host} pid {os.getpid()}), last completed step "
            f"{self._step}; threads:\n{table}\n\n{stacks}"
        )

    def _py_spy_dumps(self, culprits: list[int], hang_dir: Path, stamp: str, step: int) -> None:
        """Stacks of culprits on this host that cannot dump themselves (py-spy, if installed)."""
        py_spy = shutil.which("py-spy")
        if py_spy is None:
            return
        for rank, hb in self._read_heartbeats().items():
            if rank not in culprits or rank == self.rank or hb.host != self.host:
                continue
            proc = subprocess.run(
                [py_spy, "dump", "--pid", str(hb.pid)], capture_output=True, text=True, timeout=60
            )
            write_text_atomic(
                hang_dir / f"{stamp}-step{step}-rank{rank}-py-spy.txt", proc.stdout + proc.stderr
            )


_watchdog: HangWatchdog | None = None


def start(run_dir: Path, hang_timeout_s: float, first_step_timeout_s: float) -> None:
    """Arm the watchdog for this process (0 disables); it starts at the first `progress()`."""
    global _watchdog
    if hang_timeout_s <= 0:
        return
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    store = None
    if world_size > 1 and "MASTER_ADDR" in os.environ:
        import torch.distributed as dist

        # A client of its own (the trainer's store object is not shared across threads).
        # Keys are per torchrun restart, so a restarted worker group never sees old beats.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=30),
        )
    prefix = f"watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    _watchdog = HangWatchdog(
        run_dir, hang_timeout_s, first_step_timeout_s, rank, world_size, store, prefix
    )


def progress(step: int, step_done: bool = False) -> None:
    if _watchdog is not None:
        _watchdog.progress(step, step_done)


def stop() -> None:
    if _watchdog is not None:
        _watchdog.stop()
