"""One live run per run folder: a lease with heartbeats, `RUN/lease.json`.

Why: everything a run writes lives in its folder (checkpoints, `metrics.jsonl`, incidents),
and nothing used to stop a second run from writing the same folder. It happened as a user
would meet it: a launcher killed with `kill -9` (or by the out-of-memory killer, or a closed
terminal) left its workers training, and a relaunch on the same folder started training
beside them; two step sequences then interleaved in `metrics.jsonl` and both runs saved the
same checkpoints. The workers now die with their launcher (`common.process.follow_launcher`);
this lease is the second half: a launch on a folder that a live run holds is refused, in
one line naming where that run lives (host, PID), before anything is written.

Why a lease file and not `flock`: run folders sit on the shared filesystems clusters use
(Lustre, NFS, GPFS), where `flock` is local to a client, emulated, or off depending on mount
options, and a requeued SLURM job resumes on another node whose kernel knows nothing of the
first node's locks. What every one of them does provide: a hard link is created atomically
or fails, a rename replaces a file atomically, and a file opened after another client closed
it shows that client's writes. So:

- Taking a free folder: the record is written whole into a temporary file, then hard-linked
  to `RUN/lease.json` (fails if it exists; NFS's own lock-file recipe, safe where `O_EXCL`
  was not). Readers never see half a record.
- The record: host, PID, the process's start time (a reused PID is not the holder), the
  machine identity (host name, boot id, PID namespace: where a PID check means something),
  the SLURM job and attempt, when it started, its last beat and a beat counter, the beat
  interval, and a random token for this holding.
- Holding it: rank 0 of the run, from start-up (before it writes anything in RUN) to its
  exit; a thread renews the beat every `BEAT_INTERVAL_S` (a read, then a write of a temp
  file and a rename). If the token it reads is no longer its own, another launch took the
  lease over (this run's beats had stopped for longer than the timeout: a stopped process,
  a filesystem gone away) and this run must stop: `on_lost`.
- Letting it go: a normal exit deletes the file. A killed holder cannot; the next launch
  judges it (`judge`):
  - on the same machine: the PID check decides at once (gone, or a different process with
    that PID: stale; alive: live);
  - an earlier attempt of the same SLURM job (a requeue, maybe on another node): stale at
    once. SLURM ends an attempt before it starts the next, so that holder is gone, and the
    requeued job must not wait out a timeout to resume;
  - on another machine: never on timestamps alone. The record's beat time is the other
    machine's wall clock, and clocks of two nodes can differ by minutes (a node whose NTP
    stopped, a VM resumed from a pause): judged against this clock, a healthy run two
    minutes ahead looked dead, was taken over, and exited. So the beat counter is watched,
    on this process's own monotonic clock, for `STALE_BEATS` of the holder's beat intervals
    (2 minutes: NFS clients may cache what they read for up to a minute): a counter that
    moves means a live run (refused, within about one beat interval); one that stays still
    that long means a dead one, however old or new its timestamp reads.
- Taking over a stale lease: it is read again just before (the holder may have changed),
  replaced by a rename, then read back after a moment (`SETTLE_S`): of two launches racing
  for the same stale lease the later rename wins, and the other one sees it and is refused.
  Taking over says so on stderr, naming the run it replaces.

`python -m train --check` (the launchers' preflight, and `scripts/slurm/submit.py`)
judges the lease without taking it, so a live run is refused before torchrun starts or
the job is queued; rank 0 takes it at start-up, which also settles a race between two
launches that both passed the check.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

from common.process import machine_identity, process_alive, process_start_ticks
from common.run_layout import LEASE

BEAT_INTERVAL_S = 15.0
STALE_BEATS = 8  # a lease from another machine is stale after this many missed beats
SETTLE_S = 1.0  # after a takeover: the time a racing launch has to show its own rename

FREE, OURS, LIVE, STALE, UNSURE = "free", "ours", "live", "stale", "unsure"


LEASE_TOKEN_ENV = "TRAIN_RUN_LEASE_TOKEN"
"""The lease token a replica-group launcher hands its groups (`RunLease.admit`)."""


class LeaseHeld(ValueError):
    """The run folder is held by a live run (a user error: one line, exit 2)."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or wants) a run folder's lease: one process's identity and beat."""

    host: str  # short host name, for messages
    machine: str  # host name + boot id + PID namespace: where `pid` can be checked
    pid: int
    pid_start: int | None  # the process's start time in clock ticks after boot (Linux)
    job: str | None  # "CLUSTER:JOBID" under SLURM
    attempt: int  # SLURM_RESTART_COUNT: 0, then +1 per requeue
    started: float
    beat: float
    seq: int  # the beat counter: a live holder moves it every `interval_s`
    interval_s: float
    token: str  # random, one per holding

    @classmethod
    def this_process(cls, now: float, interval_s: float = BEAT_INTERVAL_S) -> Holder:
        env = os.environ
        job = env.get("SLURM_JOB_ID")
        if job:
            job = f"{env.get('SLURM_CLUSTER_NAME', '')}:{job}"
        return cls(
            host=socket.gethostname().split(".")[0],
            machine=machine_identity(),
            pid=os.getpid(),
            pid_start=process_start_ticks(os.getpid()),
            job=job,
            attempt=int(env.get("SLURM_RESTART_COUNT") or 0),
            started=now,
            beat=now,
            seq=0,
            interval_s=interval_s,
            token=uuid.uuid4().hex,
        )

    @classmethod
    def parse(cls, text: str) -> Holder:
        fields = json.loads(text)
        return cls(**{name: fields[name] for name in cls.__dataclass_fields__})

    def dumps(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    def describe(self, now: float) -> str:
        if self is UNREADABLE:
            return "an unreadable record"
        job = f", SLURM job {self.job.split(':', 1)[1]} attempt {self.attempt}" if self.job else ""
        # the beat is stamped by the holder's clock: on another machine, only a guide
        return (
            f"host {self.host} pid {self.pid}{job}, last beat {max(0.0, now - self.beat):.0f} s "
            "ago by this clock"
        )


# what `RunLease.read` returns for a file that is not a lease record
UNREADABLE = Holder(
    host="?", machine="?", pid=0, pid_start=None, job=None, attempt=0, started=0.0, beat=0.0,
    seq=0, interval_s=BEAT_INTERVAL_S, token="unreadable",
)  # fmt: skip


def stale_after_s(interval_s: float) -> float:
    """How long a holder on another machine may go without a beat before it counts as gone."""
    return STALE_BEATS * interval_s


@dataclass(frozen=True)
class Verdict:
    state: str  # FREE, OURS, LIVE or STALE (UNSURE only from `judge`)
    holder: Holder | None = None
    reason: str = ""


def judge(
    holder: Holder,
    me: Holder,
    alive: Callable[[int, int | None], bool] = process_alive,
) -> Verdict:
    """What `me` may do about a lease held by `holder`, from one reading (no timestamps)."""
    if holder.token == me.token:
        return Verdict(OURS, holder)
    if holder is UNREADABLE:
        return Verdict(STALE, holder, "the file is not a lease record")
    if holder.job is not None and holder.job == me.job and holder.attempt < me.attempt:
        return Verdict(STALE, holder, f"an earlier attempt ({holder.attempt}) of this SLURM job")
    if holder.machine == me.machine:
        if alive(holder.pid, holder.pid_start):
            return Verdict(LIVE, holder, "its process is running on this machine")
        return Verdict(STALE, holder, "its process is gone")
    # another machine: its beat time is its own clock's, so only its counter can tell
    return Verdict(UNSURE, holder, "on another machine: its beat counter decides")


def _write_synced(fh: IO[str], holder: Holder) -> None:
    """`holder`'s record into the open file `fh`, on disk when this returns; closes it."""
    with fh:
        fh.write(holder.dumps())
        fh.flush()
        os.fsync(fh.fileno())


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class RunLease:
    """The lease of one run folder, as seen (and maybe held) by this process."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        clock: Any = time,
        interval_s: float = BEAT_INTERVAL_S,
        alive: Callable[[int, int | None], bool] = process_alive,
        me: Holder | None = None,
        say: Callable[[str], None] = _say,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LEASE
        # wall time (beats in the record), monotonic time (how long this process watched)
        # and sleep: the `time` module's, or the tests' fake
        self.clock = clock
        self.alive = alive
        self.me = me or Holder.this_process(self.clock.time(), interval_s)
        self.say = say
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned_io = False

    # ------------------------------------------------------------------ reading
    def read(self) -> Holder | None:
        """The record on disk; None when there is none. A file that does not parse (not
        written by this module, or by a writer without atomic renames) is judged after
        SETTLE_S: still unreadable, it holds nothing."""
        for second_look in (False, True):
            try:
                return Holder.parse(self.path.read_text())
            except FileNotFoundError:
                return None
            except (ValueError, KeyError, TypeError):  # also bytes that are not UTF-8
                if second_look:
                    return UNREADABLE
                self.clock.sleep(SETTLE_S)
        raise AssertionError("unreachable")

    def inspect(self) -> Verdict:
        """FREE, OURS, LIVE or STALE. A holder on another machine that beat recently is
        watched until its beat counter moves (LIVE) or it stays still for the stale time
        (STALE), on this process's own clock."""
        holder = self.read()
        while holder is not None:
            verdict = judge(holder, self.me, self.alive)
            if verdict.state != UNSURE:
                return verdict
            wait_s = stale_after_s(holder.interval_s)
            self.say(
                f"[lease] {self.path}: held by {holder.describe(self.clock.time())}; "
                f"watching it for up to {wait_s:.0f} s to tell whether that run is alive"
            )
            since = self.clock.monotonic()
            while True:
                self.clock.sleep(max(0.5, holder.interval_s / 3))
                now = self.read()
                if now is None or now.token != holder.token:
                    holder = now  # released, or someone else holds it now: judge that
                    break
                if now.seq != holder.seq:
                    return Verdict(LIVE, now, "its beat counter moves")
                if self.clock.monotonic() - since > wait_s:
                    return Verdict(STALE, now, f"no beat seen for {wait_s:.0f} s")
        return Verdict(FREE)

    def refusal(self, verdict: Verdict) -> LeaseHeld:
        assert verdict.holder is not None
        return LeaseHeld(
            f"{self.run_dir} is in use by a live run ({verdict.holder.describe(self.clock.time())}; "
            f"lease {self.path}): two runs must not write one run folder. Stop that run "
            "first, or give this one another [job] folder"
        )

    def check(self) -> Verdict:
        """Refuse (LeaseHeld) when a live run holds the folder; take nothing."""
        verdict = self.inspect()
        if verdict.state == LIVE:
            raise self.refusal(verdict)
        return verdict

    # ------------------------------------------------------------------ holding
    def acquire(self) -> None:
        """Take the lease, or raise LeaseHeld naming the live run that holds it. A stale
        lease is taken over, with a warning naming the run it belonged to."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # each round lost to a racing launch judges the winner again
            verdict = self.check()  # LeaseHeld when a live run holds it
            if verdict.state == OURS:
                return
            if verdict.state == FREE:
                if self._create():
                    return
                continue
            stale = verdict.holder
            assert stale is not None
            current = self.read()
            if current is None or current.token != stale.token:
                continue  # it changed since it was judged
            self.say(
                f"warning: {self.path}: taking over the lease of a run that is not live "
                f"({stale.describe(self.clock.time())}; {verdict.reason})"
            )
            self._write(self._beaten())
            self.clock.sleep(SETTLE_S)
            now = self.read()
            if now is not None and now.token == self.me.token:
                return
        raise LeaseHeld(
            f"{self.path}: other launches kept taking this run folder's lease while this one "
            "tried to; make sure only one run uses the folder, then launch again"
        )

    def admit(self, token: str) -> None:
        """A replica group of the run whose launcher holds the lease (it hands its groups
        the holding's token in `LEASE_TOKEN_ENV`): admitted while the lease on disk is that
        holding and live; anyone else is refused as by `acquire` (LeaseHeld, one line)."""
        verdict = self.inspect()
        holder = verdict.holder
        if token and holder is not None and holder.token == token and verdict.state != STALE:
            return
        if verdict.state == LIVE:
            raise self.refusal(verdict)
        raise LeaseHeld(
            f"{self.path}: a run of replica groups is started by its launcher, which holds "
            "this lease for its groups (scripts/train_local.sh --replica-groups N, or "
            "scripts/slurm/submit.py --replica-groups N); launch it that way"
        )

    def renew(self) -> bool:
        """One beat. False when the lease is someone else's now (this run must stop);
        True otherwise, also when the filesystem failed this time (the next beat retries)."""
        try:
            current = self.read()
            if current is None:  # deleted under us (RUN removed by hand): take it again
                return self._create()
            if current.token != self.me.token:
                return False
            self._write(self._beaten())
            self._warned_io = False
        except OSError as err:
            if not self._warned_io:
                self.say(f"warning: {self.path}: could not renew the lease ({err}); retrying")
                self._warned_io = True
        return True

    def release(self) -> None:
        """Delete the lease if it is still this process's."""
        self._stop.set()
        with contextlib.suppress(OSError):
            current = self.read()
            if current is not None and current.token == self.me.token:
                self.path.unlink()

    def start_beating(self, on_lost: Callable[[Holder | None], object]) -> None:
        """Renew every interval in a daemon thread; `on_lost(new holder)` when it is lost."""

        def run() -> None:
            while not self._stop.wait(self.me.interval_s):
                if not self.renew() and not self._stop.is_set():
                    on_lost(self.read())
                    return

        self._thread = threading.Thread(target=run, name="run-lease", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def held(self, on_lost: Callable[[Holder | None], object]) -> Iterator[RunLease]:
        """Acquire, beat while the body runs, release at its end."""
        self.acquire()
        self.start_beating(on_lost)
        try:
            yield self
        finally:
            self.release()

    # ------------------------------------------------------------------ writing
    def _beaten(self) -> Holder:
        self.me = replace(self.me, beat=self.clock.time(), seq=self.me.seq + 1)
        return self.me

    def _write_temp(self, holder: Holder) -> Path:
        tmp = self.path.with_name(f".{LEASE}.{self.me.token}.tmp")
        _write_synced(open(tmp, "w"), holder)
        return tmp

    def _write(self, holder: Holder) -> None:
        os.replace(self._write_temp(holder), self.path)

    def _create(self) -> bool:
        """Create the lease if there is none (atomically); whether this process made it."""
        tmp = self._write_temp(self._beaten())
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: exclusive create instead
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            _write_synced(os.fdopen(fd, "w"), self.me)
            return True
        finally:
            tmp.unlink(missing_ok=True)
