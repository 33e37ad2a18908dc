"""Hang watchdog: a rank that makes no progress is dumped, named, and the job ends.

Why: in synchronous training one stuck rank stops every rank at the next collective, and
nothing says which one. The collective timeout (`[comm] train_timeout_seconds`) ends the
job eventually, but every rank then fails the same way ("timed out waiting for peers"),
with no stack of the culprit and no name. The stalled rank cannot report itself either: it
may be SIGSTOPped, swapped out, or stuck in a kernel call, and then runs no code at all.

How: every rank runs a daemon thread that
1. publishes a heartbeat (a counter, its last completed step, what it is doing, host, pid)
   to the c10d TCPStore every `interval` seconds. Under torchrun that store is served by
   the torchrun agent of the first node, not by a training process, so it keeps answering
   while any worker is stopped. A stopped rank's counter freezes; a rank blocked in a
   collective keeps beating (collectives release the GIL).
2. watches this rank's own progress in *windows*: what the rank is doing, since when, and
   how long it may take without progress (`Window`). They are opened:
   - a training step (the trainer's step hook `StepWindows`): `progress(step)` at each step boundary, then `micro_batch(i,
     seq_len)` at the start of each of its micro-batches: each micro-batch gets its own
     window, `train.reliability.budgets.Budgets.micro_batch_window_s` (a margin over the plan's
     predicted micro-batch time, at least `hang_timeout_s`), so a step of 8 micro-batches
     of 11 s (128K on 64 H100s) is 8 windows, not one. The first micro-batch of the first
     step after a (re)start, and of the first step at each new seq_len (`new_shape`), gets
     the predicted compile time on top (`compile_window_s`, at least `[comm]
     init_timeout_seconds`). `progress(step, step_done=True)` when its compute is done;
   - a checkpoint save: `phase("checkpoint save", step, extra_s)`, allowed
     `hang_timeout_s + extra_s`, where the trainer derives `extra_s` from the bytes the
     save writes and `[fault_tolerance] min_save_gb_per_s`. A save is one call with no
     progress to report inside it, so its budget scales with what it must write: at 70B
     the final save (~850 GB) may take many minutes, and a save stuck beyond its budget is
     still a hang;
   - a validation: `phase("validation", step)` and `beat("batch")` at the start of each
     batch: each batch must start within `hang_timeout_s` of the last, however many
     batches there are.
   The first time a phase runs in this process its first windows (up to its first beat's)
   get at least the first-step timeout: the eval forward compiles again, the first async
   save starts DCP's checkpoint daemon.
   When a window runs out, the first rank of its host to see one run out reads every
   heartbeat twice, `2 * interval` apart, and names the culprit (`diagnose`); the host's
   other ranks read none (`_node_reader`: a claim in the store, renewed while its window
   stays out), and follow the reader's verdict. A read is one `multi_get` of every rank's
   key: at 1,024 ranks, 2,048 requests one key at a time per read, by every detecting
   rank, could outlast the 60 s by which the collective timeouts outlast the windows
   (docs/bench/heartbeats-2026-11-26.md: 19x on loopback at 1,024 ranks). The culprit is
   named:
   - ranks whose counter did not move: "stopped responding" (SIGSTOP, a dead host,
     a process that no longer runs Python code);
   - else ranks whose last completed step is behind the others;
   - else every rank is alive at the same step: a collective or I/O that never returns,
     named with what the ranks were doing (a step, a save, a validation batch).
3. writes the stacks of all of this rank's threads (`faulthandler`) with that verdict to
   `RUN/hang/<time>-step<S>-rank<R>.txt`; with py-spy installed, also the stacks of a
   named culprit on the same host (py-spy can read a stopped process);
4. the first reader to claim the report writes `RUN/hang/hang.json` and prints one line
   `error: hang: rank R ... at step S ...` to stderr; then every detecting rank exits
   with `ExitCode.HANG` (3, `common.exit_codes`), a reader's followers once it published
   its verdict. torchrun/srun then end the other processes, and under SLURM
   `train.sbatch` counts a crash and requeues: the run resumes from its newest checkpoint
   and the dataloader state makes the data exact-once.

Cost in normal running: one small TCPStore write per rank per interval (<= 5 s).

A worker also ends when its launcher does: `common.process.follow_launcher`, from
start-up.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from common.exit_codes import ExitCode
from common.io import write_json_atomic, write_text_atomic
from common.run_layout import HANG_DIR
from train.reliability.budgets import TIMEOUT_MARGIN_S, Budgets, CollectiveTimeouts
from train.step_hooks import StepHook


@dataclass
class Heartbeat:
    rank: int
    seq: int
    step: int
    host: str
    pid: int
    time: float
    where: str = ""  # the window the rank was in: "step 8", "checkpoint save after step 7"
    window_ends: float = 0.0  # wall-clock time its window's allowance runs out


@dataclass(frozen=True)
class Window:
    """What this rank is doing, since when (the last progress) and how long it may take.
    Replaced whole by the trainer's thread, read by the watchdog's: no lock needed."""

    where: str  # "step 8", "checkpoint save after step 7", "validation after step 7, batch 3"
    step: int  # the step in progress, or the completed step a save/validation follows
    since: float  # time.monotonic() when the window opened
    allowance_s: float

    def stalled_s(self, now: float) -> float | None:
        """Seconds without progress if over the allowance, else None."""
        stalled = now - self.since
        return stalled if stalled > self.allowance_s else None


def diagnose(
    first: dict[int, Heartbeat],
    second: dict[int, Heartbeat],
    world_size: int,
    rank: int,
    host: str,
    where: str,
    now: float,
) -> tuple[list[int], str]:
    """(culprit ranks, one-line reason) from two reads of every rank's heartbeat, taken
    `2 * interval` apart by rank `rank`, whose own window `where` ran out.

    The step named is the one in progress (this rank's last completed step + 1): in
    synchronous training every rank completes the same steps, and a heartbeat's own
    step may be one interval stale.
    """
    if not second:  # no store (a world of one, or it is unreachable)
        return [rank], (
            f"rank {rank} ({host} pid {os.getpid()}) made no progress in {where} "
            "(no heartbeats to compare with)"
        )
    silent = [
        r
        for r in range(world_size)
        if r not in second or (r in first and first[r].seq == second[r].seq)
    ]
    if silent:
        parts = [
            f"rank {r} never sent a heartbeat"
            if (hb := second.get(r)) is None
            else f"rank {r} ({hb.host} pid {hb.pid}) stopped responding in "
            f"{hb.where or where} (no heartbeat for {now - hb.time:.0f} s)"
            for r in silent
        ]
        return silent, "; ".join(parts)
    lowest = min(hb.step for hb in second.values())
    behind = sorted(r for r, hb in second.items() if hb.step == lowest)
    if lowest < max(hb.step for hb in second.values()):
        names = ", ".join(f"rank {r} ({second[r].host} pid {second[r].pid})" for r in behind)
        return behind, f"{names} stuck in step {lowest + 1}, behind the other ranks"
    doing = sorted({hb.where for hb in second.values() if hb.where and hb.where != where})
    others = f"; other ranks in {', '.join(doing)}" if doing else ""
    return list(range(world_size)), (
        f"all {world_size} ranks alive but none finished {where}{others} "
        "(a collective or I/O that never returns; compare the stacks)"
    )


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
        exit_process: Callable[[int], object] = os._exit,
        budgets: Budgets | None = None,
        clock: Callable[[], float] = time.monotonic,
        host: str | None = None,
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
        self.host = host or socket.gethostname().split(".")[0]  # tests name several
        self.exit_process = exit_process  # tests pass a recorder; a real hang ends the process
        self.budgets = budgets or Budgets(hang_timeout_s, self.first_step_timeout_s, 0.0)
        self._clock = clock  # tests pass a fake one
        self._compiles = True  # the next first micro-batch compiles (a start, a new seq_len)
        self._step = 0  # the last completed step
        self._window = Window("step 1", 1, clock(), self.first_step_timeout_s)
        self._first_step: int | None = None
        self._phases_run: set[str] = set()
        self._phase: tuple[str, int, float, bool] | None = None  # name, step, extra_s, first run
        self._beats = 0
        self._seq = 0
        self._reader_claim = ""  # this rank's claim to read for its host (`_node_reader`)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)

    # ---------------------------------------------------------------- trainer side
    def progress(self, step: int, step_done: bool = False) -> None:
        """Called at every step boundary (`step` completed, the next one starts), and with
        `step_done` when a step's compute is done (its checkpoint save and validation
        follow). Cheap: a few assignments."""
        if self._first_step is None:
            self._first_step = step
            self._thread.start()
        self._step = step
        if step_done:
            self._open(f"after step {step}", step, self.hang_timeout_s)
        else:
            first = step == self._first_step  # lazy init and compilation
            timeout = self.first_step_timeout_s if first else self.hang_timeout_s
            self._open(f"step {step + 1}", step + 1, timeout)

    @contextmanager
    def phase(self, name: str, step: int, extra_s: float = 0.0) -> Iterator[None]:
        """A save or validation after `step`: allowed `hang_timeout_s + extra_s` without
        progress, and each `beat()` inside it is progress. Ends with progress."""
        first_run = name not in self._phases_run
        self._phase = (name, step, extra_s, first_run)
        self._beats = 0
        self._open(f"{name} after step {step}", step, self._phase_allowance(extra_s, first_run))
        try:
            yield
        finally:
            self._phases_run.add(name)
            self._phase = None
            self._open(f"after step {step}", step, self.hang_timeout_s)

    def beat(self, unit: str) -> None:
        """Progress inside a phase: the start of its next `unit` (a validation batch)."""
        if self._phase is None:
            return
        name, step, extra_s, first_run = self._phase
        self._beats += 1
        allowance = self._phase_allowance(extra_s, first_run and self._beats == 1)
        self._open(f"{name} after step {step}, {unit} {self._beats}", step, allowance)

    def new_shape(self, what: str) -> None:
        """The step in progress meets an input shape no earlier step had (a seq_len phase
        starts): kernels are compiled again, as in the first step, so its first micro-batch
        gets the compile window, and so does drawing its batches. Called when the batch is
        drawn, before its forward."""
        window = self._window
        self._compiles = True
        self._open(f"{window.where} (first at {what})", window.step, self.first_step_timeout_s)

    def micro_batch(self, index: int, seq_len: int | None = None) -> None:
        """Progress: micro-batch `index` (1-based) of the step in progress starts, at
        `seq_len`; it may take `micro_batch_window_s(seq_len)`, the first one after a start
        or a new seq_len `compile_window_s(seq_len)`. The clipping and optimizer step after
        the last micro-batch run in its window."""
        step = self._window.step
        compiles = self._compiles and index == 1
        self._compiles = self._compiles and not compiles
        b = self.budgets
        allowance = b.compile_window_s(seq_len) if compiles else b.micro_batch_window_s(seq_len)
        at = f", seq_len {seq_len}" if seq_len else ""
        self._open(f"step {step}, micro-batch {index}{at}", step, allowance)

    def _phase_allowance(self, extra_s: float, compiles: bool) -> float:
        allowance = self.hang_timeout_s + extra_s
        return max(allowance, self.first_step_timeout_s) if compiles else allowance

    def _open(self, where: str, step: int, allowance_s: float) -> None:
        self._window = Window(where, step, self._clock(), allowance_s)

    def stop(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- thread side
    def _key(self, rank: int) -> str:
        return f"{self.key_prefix}/{rank}"

    def _ask_store(self, op: str, *args, default=None):
        """`store.op(*args)`, or `default` without a store or when it fails: the store
        being gone must not kill training, and detection goes on."""
        if self.store is None:
            return default
        try:
            return getattr(self.store, op)(*args)
        except Exception:
            return default

    def _beat(self) -> None:
        self._seq += 1
        record = {"seq": self._seq, "step": self._step, "host": self.host}
        window, now = self._window, time.time()
        ends = now + window.allowance_s - (time.monotonic() - window.since)
        record |= {"pid": os.getpid(), "time": now, "where": window.where, "window_ends": ends}
        self._ask_store("set", self._key(self.rank), json.dumps(record))

    def _read_heartbeats(self) -> dict[int, Heartbeat]:
        """Every rank's last heartbeat: one `multi_get` (a rank that never beat, at a start,
        costs one `check` per rank to find the others)."""
        if self.store is None:
            return {}
        ranks = list(range(self.world_size))
        try:
            if not self.store.check([self._key(r) for r in ranks]):
                ranks = [r for r in ranks if self.store.check([self._key(r)])]
            values = self.store.multi_get([self._key(r) for r in ranks]) if ranks else []
            return {r: Heartbeat(r, **json.loads(v)) for r, v in zip(ranks, values, strict=True)}
        except Exception:  # the store gone: nothing to compare; detection goes on
            return {}

    def _node_reader(self) -> bool:
        """Whether this rank reads the heartbeats for its host: the first of the host's
        ranks whose window ran out claims it in the store (`rank time`), renews the claim at
        each look while its window stays out, and gives it back when its rank progresses
        again; a claim not renewed for as long as a heartbeat stays fresh (its rank is gone
        or frozen) passes to the next. Without a store to agree through, every rank reads
        for itself."""
        if self.store is None:
            return True
        key = self._reader_key()
        now = time.time()
        mine = f"{self.rank} {now}"
        try:
            held = self.store.compare_set(key, "", mine).decode()
            if held != mine:
                holder, _, stamp = held.partition(" ")
                if int(holder) != self.rank and now - float(stamp) <= self._fresh_s():
                    return False
                held = self.store.compare_set(key, held, mine).decode()
            self._reader_claim = mine if held == mine else ""
            return held == mine
        except Exception:
            return True

    def _reader_key(self) -> str:
        return f"{self.key_prefix}/reader/{self.host}"

    def _fresh_s(self) -> float:
        """How long a heartbeat (or a reader's claim) vouches for its rank: a loaded host
        can pause a thread for a beat or two."""
        return max(3 * self.interval, self.hang_timeout_s / 2)

    def _node_verdict(self) -> str | None:
        """The hang message the host's reader published, if it named one."""
        key = f"{self.key_prefix}/verdict/{self.host}"
        verdict = self._ask_store("get", key) if self._ask_store("check", [key]) else None
        return None if verdict is None else verdict.decode()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()
            if self.check():
                return

    def check(self) -> bool:
        """One look of the watchdog's thread: report a hang (and end the process) when this
        rank's window ran out; True if it did."""
        stalled_s = self._window.stalled_s(self._clock())
        if stalled_s is None and self._reader_claim:  # progress again: give the claim back
            claim, self._reader_claim = self._reader_claim, ""  # the host's next stall reads
            self._ask_store("compare_set", self._reader_key(), claim, "")
        if stalled_s is None or self._stop.is_set():
            return False
        verdict = self._node_verdict()  # this host's reader named the hang: follow it
        if verdict is not None:
            self._on_hang(stalled_s, verdict)
            return True
        if not self._node_reader():  # another rank of this host reads for it
            return False
        if self._another_rank_within_its_window():
            return False  # waiting on a rank in a longer phase (a save) is not a hang
        self._on_hang(stalled_s)
        return True

    def _another_rank_within_its_window(self) -> bool:
        """Whether another rank's window (say, a checkpoint save with its write budget) has
        not run out yet. A rank that waits for it in a collective (validation's first batch
        after the save) is not hung: it is judged when that longer window ends, and a real
        stall inside it is caught then, by the stalled rank itself or by this one.

        Only a fresh heartbeat counts: a rank whose watchdog thread stopped beating (the
        process is stopped or frozen) cannot vouch for its window. Its last beat may show a
        long window it has long left (the first step's, beaten just before a fast step and
        a SIGSTOP), which would otherwise hold every other rank for that window's length."""
        now = time.time()
        fresh_s = self._fresh_s()
        return any(
            beat.rank != self.rank and beat.window_ends > now and now - beat.time <= fresh_s
            for beat in self._read_heartbeats().values()
        )

    def _diagnose(self, window: Window) -> tuple[list[int], str, dict[int, Heartbeat]]:
        """Two heartbeat reads, `2 * interval` apart, judged by `diagnose`; and the second."""
        first = self._read_heartbeats()
        # a world of one (no store) has no heartbeats to compare: nothing to wait for
        deadline = time.monotonic() + (2 * self.interval + 0.5 if self.store is not None else 0.0)
        while time.monotonic() < deadline:
            self._beat()
            self._node_reader()  # renews the claim: the host's others keep waiting for it
            time.sleep(self.interval / 2)
        second = self._read_heartbeats()
        verdict = diagnose(
            first, second, self.world_size, self.rank, self.host, window.where, time.time()
        )
        return *verdict, second

    def _on_hang(self, stalled_s: float, verdict: str | None = None) -> None:
        """Dump this rank's stacks and end the process with `ExitCode.HANG`. The host's reader
        (`verdict` None) first names the culprit, publishes its message for the host's other
        ranks, dumps a culprit's stacks on this host (py-spy) and, if it is the first reader
        to claim the report, writes hang.json and prints the line; a follower dumps its
        stacks under its reader's `verdict`."""
        window = self._window
        step = window.step
        hang_dir = self.run_dir / HANG_DIR
        stem = hang_dir / f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-step{step}-rank"
        dump = Path(f"{stem}{self.rank}.txt")
        try:
            hang_dir.mkdir(parents=True, exist_ok=True)
            if verdict is not None:
                mine = f"rank {self.rank}: {stalled_s:.0f} s without progress in {window.where}"
                write_text_atomic(dump, f"{verdict}\n{mine}\n\n{self._own_stacks()}")
                return
            culprits, reason, beats = self._diagnose(window)
            message = (
                f"hang: {reason}; detected by rank {self.rank} after {stalled_s:.0f} s without "
                f"progress in {window.where} (allowed {window.allowance_s:.0f} s; "
                f"hang_timeout_s={self.hang_timeout_s:g}); stacks in {self.run_dir / HANG_DIR}/"
            )
            self._ask_store("set", f"{self.key_prefix}/verdict/{self.host}", message)
            write_text_atomic(dump, f"{message}\n\n{self._own_stacks()}")
            self._py_spy_dumps(culprits, beats, stem)
            # one report: not each host's reader at once into the same file
            if self._claim("reported") and not self._reported_in_this_attempt(hang_dir):
                record = {"culprit_ranks": culprits, "step": step, "reason": reason}
                record |= {"where": window.where, "allowed_s": window.allowance_s}
                record["last_completed_step"] = self._step
                record |= {"detected_by": self.rank, "stalled_s": stalled_s, "time": time.time()}
                write_json_atomic(hang_dir / "hang.json", record)
                print(f"error: {message}", file=sys.stderr, flush=True)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            self.exit_process(ExitCode.HANG)

    def _claim(self, name: str) -> bool:
        """Whether this rank is the first to claim `name` (always, without a store)."""
        key, mine = f"{self.key_prefix}/{name}", str(self.rank)
        return self._ask_store("compare_set", key, "", mine, default=mine.encode()).decode() == mine

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

    def _py_spy_dumps(self, culprits: list[int], beats: dict[int, Heartbeat], stem: Path) -> None:
        """Stacks of culprits on this host that cannot dump themselves (py-spy, if installed),
        each in `stem` + its rank + `-py-spy.txt`."""
        py_spy = shutil.which("py-spy")
        if py_spy is None:
            return
        for rank, hb in beats.items():
            if rank not in culprits or rank == self.rank or hb.host != self.host:
                continue
            proc = subprocess.run(
                [py_spy, "dump", "--pid", str(hb.pid)], capture_output=True, text=True, timeout=60
            )
            write_text_atomic(f"{stem}{rank}-py-spy.txt", proc.stdout + proc.stderr)


_watchdog: HangWatchdog | None = None


def start(run_dir: Path, budgets: Budgets) -> None:
    """Arm the watchdog for this process (hang_timeout_s 0 disables); it starts at the first
    `progress()`."""
    global _watchdog
    if budgets.hang_timeout_s <= 0:
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
        run_dir,
        budgets.hang_timeout_s,
        budgets.first_step_timeout_s,
        rank,
        world_size,
        store,
        prefix,
        budgets=budgets,
    )


def phase(name: str, step: int, extra_s: float = 0.0) -> contextlib.AbstractContextManager:
    """A checkpoint save or validation after `step` (see `HangWatchdog.phase`)."""
    return contextlib.nullcontext() if _watchdog is None else _watchdog.phase(name, step, extra_s)


def beat(unit: str) -> None:
    if _watchdog is not None:
        _watchdog.beat(unit)


def stop() -> None:
    if _watchdog is not None:
        _watchdog.stop()


class StepWindows(StepHook):
    """A step hook: the step's watchdog windows (this module's essay, 2.), and every mesh
    group's collective timeout raised for the step at a new seq_len: every rank compiles
    again there, some slower than others, so the timeout outlasts the compile window and
    the watchdog names a rank that never finishes, not NCCL; restored after that step."""

    def __init__(self, budgets: Budgets, timeouts: CollectiveTimeouts) -> None:
        self.budgets, self.timeouts = budgets, timeouts
        self._seq_lens: set[int] = set()
        self._seq_len: int | None = None  # of the last micro-batch drawn
        self._micro_batch = 0  # within the step
        self._raised: contextlib.ExitStack | None = None

    @classmethod
    def from_trainer(cls, trainer) -> StepWindows:
        # every mesh group's collective timeout: raised for a new seq_len, a save, a rollback
        timeouts = CollectiveTimeouts.of_mesh(
            trainer.parallel_dims, trainer.config.comm.train_timeout_seconds
        )
        trainer.checkpointer.save_window.timeouts = timeouts
        return cls(trainer.budgets, timeouts)

    def begin_step(self, step: int) -> None:
        self._micro_batch = 0

    def on_batch(self, labels) -> None:
        seq_len = self._seq_len = labels.shape[-1]
        if seq_len not in self._seq_lens:
            if self._seq_lens:
                if _watchdog is not None:  # that step compiles again, like the first
                    _watchdog.new_shape(f"seq_len {seq_len}")
                if self._raised is None:
                    self._raised = contextlib.ExitStack()
                    needed = self.budgets.compile_window_s(seq_len) + TIMEOUT_MARGIN_S
                    self._raised.enter_context(self.timeouts.raised_to(needed))
            self._seq_lens.add(seq_len)

    def before_forward(self) -> None:
        self._micro_batch += 1
        if _watchdog is not None:
            _watchdog.micro_batch(self._micro_batch, self._seq_len)

    def after_step(self, step: int, *, skipped: bool, sums) -> None:
        if self._raised is not None:  # the step at a new seq_len is done
            self._raised.close()  # behind a barrier: every rank is done too
            self._raised = None
        if _watchdog is not None:
            _watchdog.progress(step, step_done=True)  # the save + validation: a new window

    def at_boundary(self, step: int) -> None:
        if _watchdog is not None:
            _watchdog.progress(step)  # a step boundary is progress
