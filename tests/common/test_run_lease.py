"""common.run_lease: one live run per run folder, judged on a fake clock (no sleeps).

Real files in a temporary folder and real process checks (this test process is a live
holder; a finished child process is a dead one); only time is simulated, so a two-minute
stale timeout costs nothing. The end-to-end refusal and takeover through the launchers is
tests/scripts/test_launchers.py's.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess

import pytest

from common.process import process_start_ticks
from common.run_layout import LEASE
from common.run_lease import (
    BEAT_INTERVAL_S,
    SETTLE_S,
    Holder,
    LeaseHeld,
    RunLease,
    stale_after_s,
)


class FakeClock:
    """Wall and monotonic time that only `sleep` moves; `on_sleep` lets a test act as the
    other holder while this one waits (beat, take over)."""

    def __init__(self):
        self.wall, self.mono = 1_800_000_000.0, 0.0
        self.on_sleep = None

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def sleep(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds
        if self.on_sleep is not None:
            self.on_sleep()


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(name, raising=False)


def other_machine(clock: FakeClock, **fields) -> Holder:
    """A holder on another node, that beat just now."""
    holder = Holder(
        host="node7", machine="node7|boot|pid:[1]", pid=4242, pid_start=99, job=None,
        attempt=0, started=clock.wall, beat=clock.wall, seq=3,
        interval_s=BEAT_INTERVAL_S, token="theirs",
    )  # fmt: skip
    return dataclasses.replace(holder, **fields)


def write(run_dir, holder: Holder) -> None:
    (run_dir / LEASE).write_text(holder.dumps())


def on_disk(run_dir) -> Holder:
    return Holder.parse((run_dir / LEASE).read_text())


def _finished_child() -> int:
    """The PID of a process that has finished (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_live_run_on_this_machine_is_refused_in_one_line_naming_host_and_pid(tmp_path):
    clock, said = FakeClock(), []
    first = RunLease(tmp_path, clock=clock, say=said.append)
    first.acquire()
    assert on_disk(tmp_path).pid == os.getpid() and on_disk(tmp_path).token == first.me.token

    second = RunLease(tmp_path, clock=clock, say=said.append)  # same machine, holder alive
    for attempt in (second.check, second.acquire):
        with pytest.raises(LeaseHeld) as refused:
            attempt()
        message = str(refused.value)
        assert "\n" not in message
        host = socket.gethostname().split(".")[0]
        assert f"in use by a live run (host {host} pid {os.getpid()}," in message
    assert clock.mono == 0.0  # the PID check decides at once
    assert on_disk(tmp_path).token == first.me.token and said == []

    first.release()
    assert not (tmp_path / LEASE).exists()
    second.acquire()
    assert on_disk(tmp_path).token == second.me.token


def test_a_dead_holder_on_this_machine_is_taken_over_at_once_with_a_warning(tmp_path):
    clock, said = FakeClock(), []
    lease = RunLease(tmp_path, clock=clock, say=said.append)
    me = lease.me
    write(tmp_path, dataclasses.replace(me, pid=_finished_child(), token="killed"))
    assert lease.check().state == "stale"
    lease.acquire()
    assert on_disk(tmp_path).token == me.token
    assert clock.mono == SETTLE_S  # no stale timeout to wait out
    assert (
        len(said) == 1 and "taking over the lease" in said[0] and "its process is gone" in said[0]
    )

    # a live PID that belongs to a later process (the holder's PID was reused): also stale
    write(tmp_path, dataclasses.replace(me, pid_start=process_start_ticks(os.getpid()) - 1))
    again = RunLease(tmp_path, clock=clock, say=said.append)
    again.acquire()
    assert on_disk(tmp_path).token == again.me.token


def test_a_requeued_slurm_job_takes_over_its_earlier_attempt_but_not_another_job(tmp_path):
    clock, said = FakeClock(), []
    attempt1 = other_machine(clock, job="cluster:42", attempt=1, token="attempt1")
    write(tmp_path, other_machine(clock, job="cluster:42", attempt=0))  # beat just now
    lease = RunLease(tmp_path, clock=clock, me=attempt1, say=said.append)
    lease.acquire()
    assert on_disk(tmp_path).token == "attempt1"
    assert clock.mono == SETTLE_S  # at once, though the old attempt beat a moment ago
    assert "earlier attempt (0) of this SLURM job" in said[0]

    # another job, still beating on its node: refused within about one beat interval
    live = other_machine(clock, job="cluster:43")
    write(tmp_path, live)
    beats = iter(range(live.seq + 1, 1000))
    clock.on_sleep = lambda: write(tmp_path, dataclasses.replace(live, seq=next(beats)))
    elsewhere = dataclasses.replace(attempt1, machine="node9|boot|pid:[1]", job="cluster:44")
    other_job = RunLease(tmp_path, clock=clock, me=dataclasses.replace(elsewhere, token="44"))
    start = clock.mono
    with pytest.raises(LeaseHeld, match=r"host node7 pid 4242, SLURM job 43 attempt 0"):
        other_job.acquire()
    assert clock.mono - start <= BEAT_INTERVAL_S
    assert on_disk(tmp_path).job == "cluster:43"


def test_a_silent_holder_on_another_machine_is_stale_after_the_timeout(tmp_path):
    clock, said = FakeClock(), []
    write(tmp_path, other_machine(clock, beat=clock.wall - 10))
    lease = RunLease(tmp_path, clock=clock, say=said.append)
    lease.acquire()
    assert on_disk(tmp_path).token == lease.me.token
    waited = clock.mono - SETTLE_S
    timeout = stale_after_s(BEAT_INTERVAL_S)
    assert timeout <= waited <= timeout + BEAT_INTERVAL_S
    assert "watching it for up to 120 s" in said[0] and "no beat seen for 120 s" in said[1]

    # a beat that reads far older than the timeout is watched all the same: its time is
    # the other machine's clock (below); a silent holder is taken over after the window
    write(tmp_path, other_machine(clock, beat=clock.wall - timeout - 1000))
    start = clock.mono
    RunLease(tmp_path, clock=clock, say=said.append).acquire()
    assert timeout <= clock.mono - start - SETTLE_S <= timeout + BEAT_INTERVAL_S


@pytest.mark.parametrize("skew_s", [-600.0, -150.0, 600.0])
def test_a_beating_holder_on_a_skewed_clock_is_live_whatever_its_timestamps(tmp_path, skew_s):
    """A run on another machine whose clock is minutes behind (or ahead of) this one stamps
    beats that look stale (or from the future) here: its moving beat counter decides, and
    the launch is refused within about one beat interval."""
    clock = FakeClock()
    live = other_machine(clock, beat=clock.wall + skew_s)
    write(tmp_path, live)
    beats = iter(range(live.seq + 1, 1000))
    clock.on_sleep = lambda: write(
        tmp_path, dataclasses.replace(live, seq=next(beats), beat=clock.wall + skew_s)
    )
    lease = RunLease(tmp_path, clock=clock, say=lambda line: None)
    for attempt in (lease.check, lease.acquire):
        start = clock.mono
        with pytest.raises(LeaseHeld, match="in use by a live run .host node7 pid 4242"):
            attempt()
        assert clock.mono - start <= BEAT_INTERVAL_S
    assert on_disk(tmp_path).token == "theirs"


def test_a_holder_whose_lease_was_taken_over_learns_it_at_its_next_beat(tmp_path):
    clock = FakeClock()
    holder = RunLease(tmp_path, clock=clock, me=other_machine(clock, token="stopped"))
    holder.acquire()
    assert holder.renew() and on_disk(tmp_path).seq == holder.me.seq
    clock.sleep(stale_after_s(BEAT_INTERVAL_S) + 1)  # its process was stopped meanwhile
    taker = RunLease(tmp_path, clock=clock, say=lambda line: None)
    taker.acquire()
    assert not holder.renew()  # it must stop now
    assert on_disk(tmp_path).token == taker.me.token
    holder.release()  # not its own any more: left alone
    assert on_disk(tmp_path).token == taker.me.token


def test_of_two_launches_racing_for_a_stale_lease_the_later_one_wins(tmp_path):
    clock, said = FakeClock(), []
    write(tmp_path, other_machine(clock, beat=clock.wall - 1000))
    me = RunLease(tmp_path, clock=clock, say=said.append)
    # while this launch lets its takeover settle, a launch on this machine (alive: this
    # test process) renames its own record over it
    rival = dataclasses.replace(me.me, token="rival", pid_start=process_start_ticks(os.getpid()))
    clock.on_sleep = lambda: (write(tmp_path, rival), setattr(clock, "on_sleep", None))
    with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}"):
        me.acquire()
    assert on_disk(tmp_path).token == "rival"


def test_an_unreadable_lease_file_is_taken_over(tmp_path):
    (tmp_path / LEASE).write_text("{not json")
    clock, said = FakeClock(), []
    lease = RunLease(tmp_path, clock=clock, say=said.append)
    lease.acquire()
    assert on_disk(tmp_path).token == lease.me.token
    assert "an unreadable record" in said[0]
