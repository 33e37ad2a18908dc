"""train.reliability.watchdog's verdicts without training: windows, phase budgets, and who is named.

The real-process proofs are elsewhere: a long but progressing save and validation on 2
torchrun ranks, and a stall inside a save (tests/train/reliability/test_health.py); a
SIGSTOPped rank on a two-node SLURM cluster (tests/scripts/test_slurm_multinode.py). A
worker following its launcher is tests/common/test_process.py's.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from common.exit_codes import ExitCode
from train.reliability.watchdog import HangWatchdog, Heartbeat, diagnose

HANG_S = 80.0
FIRST_S = 600.0


def _beat(rank: int, seq: int, step: int, where: str = "", host: str = "n1") -> Heartbeat:
    return Heartbeat(
        rank=rank, seq=seq, step=step, host=host, pid=100 + rank, time=0.0, where=where
    )


# --------------------------------------------------------------------------- verdicts


def test_a_rank_whose_heartbeat_stopped_is_named_with_what_it_was_doing():
    first = {0: _beat(0, 5, 7), 1: _beat(1, 9, 7, "checkpoint save after step 7", "n2")}
    second = {0: _beat(0, 8, 7), 1: _beat(1, 9, 7, "checkpoint save after step 7", "n2")}
    culprits, reason = diagnose(first, second, 2, 0, "n1", "checkpoint save after step 7", 20.0)
    assert culprits == [1]
    assert reason == (
        "rank 1 (n2 pid 101) stopped responding in checkpoint save after step 7 "
        "(no heartbeat for 20 s)"
    )


def test_a_rank_behind_the_others_is_named():
    first = {0: _beat(0, 1, 7), 1: _beat(1, 1, 6), 2: _beat(2, 1, 7)}
    second = {0: _beat(0, 2, 7), 1: _beat(1, 2, 6), 2: _beat(2, 2, 7)}
    culprits, reason = diagnose(first, second, 3, 0, "n1", "step 8", 0.0)
    assert culprits == [1]
    assert reason == "rank 1 (n1 pid 101) stuck in step 7, behind the other ranks"


def test_all_ranks_alive_in_the_same_phase_names_the_phase():
    where = "validation after step 7, batch 3"
    first = {r: _beat(r, 1, 7, where) for r in range(2)}
    second = {r: _beat(r, 2, 7, where) for r in range(2)}
    culprits, reason = diagnose(first, second, 2, 0, "n1", where, 0.0)
    assert culprits == [0, 1]
    assert reason.startswith(f"all 2 ranks alive but none finished {where} (a collective")


def test_a_rank_that_never_beat_and_a_world_without_heartbeats():
    second = {0: _beat(0, 2, 3)}
    assert diagnose({0: _beat(0, 1, 3)}, second, 2, 0, "n1", "step 4", 0.0) == (
        [1],
        "rank 1 never sent a heartbeat",
    )
    culprits, reason = diagnose({}, {}, 1, 0, "n1", "step 4", 0.0)
    assert culprits == [0] and "made no progress in step 4 (no heartbeats" in reason


# --------------------------------------------------------------------------- windows


@pytest.fixture
def watchdog(tmp_path):
    """A world-of-one watchdog whose thread runs but, at these timeouts, never fires."""
    dog = HangWatchdog(tmp_path, HANG_S, FIRST_S, rank=0, world_size=1)
    yield dog
    dog.stop()


def _allowed(dog: HangWatchdog) -> tuple[str, float]:
    """(where, allowance) of the current window, checked against the verdict itself."""
    window = dog._window
    assert window.stalled_s(window.since + window.allowance_s - 0.01) is None
    assert window.stalled_s(window.since + window.allowance_s + 0.01) is not None
    return window.where, window.allowance_s


def test_the_first_step_and_the_first_run_of_each_phase_get_the_first_step_timeout(watchdog):
    watchdog.progress(0)
    assert _allowed(watchdog) == ("step 1", FIRST_S)
    watchdog.progress(1, step_done=True)
    assert _allowed(watchdog) == ("after step 1", HANG_S)
    with watchdog.phase("validation", 1):
        assert _allowed(watchdog) == ("validation after step 1", FIRST_S)  # loader build
        watchdog.beat("batch")
        assert _allowed(watchdog) == ("validation after step 1, batch 1", FIRST_S)  # compiles
        watchdog.beat("batch")
        assert _allowed(watchdog) == ("validation after step 1, batch 2", HANG_S)
    assert _allowed(watchdog) == ("after step 1", HANG_S)
    watchdog.progress(1)
    assert _allowed(watchdog) == ("step 2", HANG_S)
    with watchdog.phase("validation", 2):
        assert _allowed(watchdog) == ("validation after step 2", HANG_S)
        watchdog.beat("batch")
        assert _allowed(watchdog) == ("validation after step 2, batch 1", HANG_S)


def test_the_first_step_at_a_new_seq_len_gets_the_first_step_timeout(watchdog):
    watchdog.progress(0)
    watchdog.progress(5)
    assert _allowed(watchdog) == ("step 6", HANG_S)
    watchdog.new_shape("seq_len 512")  # a seq_len phase starts: compiled again
    assert _allowed(watchdog) == ("step 6 (first at seq_len 512)", FIRST_S)
    watchdog.progress(6)
    assert _allowed(watchdog) == ("step 7", HANG_S)


def test_a_save_is_allowed_the_timeout_plus_its_write_time(watchdog):
    watchdog.progress(0)
    with watchdog.phase("checkpoint save", 1, extra_s=1700.0):  # 850 GB at 0.5 GB/s
        assert _allowed(watchdog) == ("checkpoint save after step 1", HANG_S + 1700.0)
    with watchdog.phase("checkpoint save", 2, extra_s=10.0):  # the first run is past
        assert _allowed(watchdog) == ("checkpoint save after step 2", HANG_S + 10.0)
    watchdog.beat("batch")  # outside a phase: no effect
    assert _allowed(watchdog) == ("after step 2", HANG_S)


# --------------------------------------------------------------------------- the thread


class _Exits:
    """Records the watchdog's exit instead of ending the test process."""

    def __init__(self):
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


@pytest.mark.parametrize("phase", ["validation", "checkpoint save"])
def test_long_progressing_phase_passes_and_a_stall_inside_it_is_caught(tmp_path, phase):
    """Real thread, real clock, timeouts of 1 s: a phase that lasts twice the timeout but
    progresses (validation: a batch every 0.25 s; a save: within its write budget) is not
    a hang; the same phase stalling is caught, dumped and reported with its name."""
    exits = _Exits()
    dog = HangWatchdog(tmp_path, 1.0, 1.0, rank=0, world_size=1, exit_process=exits)
    dog.progress(0)
    dog.progress(1, step_done=True)
    extra_s = 3.0 if phase == "checkpoint save" else 0.0
    with dog.phase(phase, 1, extra_s):
        for _ in range(8):  # 2 s in all
            time.sleep(0.25)
            if phase == "validation":
                dog.beat("batch")
        assert not exits.done.is_set(), "a progressing phase was called a hang"
        assert exits.done.wait(timeout=10), "a stall inside the phase was not caught"
    dog.stop()
    assert exits.codes == [ExitCode.HANG]
    record = json.loads((tmp_path / "hang" / "hang.json").read_text())
    where = f"{phase} after step 1" + (", batch 8" if phase == "validation" else "")
    assert record["where"] == where and record["step"] == 1, record
    assert f"made no progress in {where}" in record["reason"]
    dumps = list((tmp_path / "hang").glob("*-step1-rank0.txt"))
    assert len(dumps) == 1 and "test_long_progressing_phase" in dumps[0].read_text()


def test_a_rank_waiting_on_another_ranks_long_save_is_not_a_hang(tmp_path):
    """Rank 0 is in validation (2 s window), blocked on rank 1, whose checkpoint save has a
    6 s budget: rank 0 waits while rank 1's window runs, and when rank 1 stalls past it the
    hang is reported. Two real watchdog threads over one real store. (Windows of seconds,
    not one: heartbeats stay fresh for 0.6 of a window, and a loaded 2-core CI box can
    pause a thread for half a second.)"""
    from torch.distributed import HashStore

    store = HashStore()
    exits = [_Exits(), _Exits()]
    dogs = [
        HangWatchdog(tmp_path, 2.0, 2.0, rank=r, world_size=2, store=store, exit_process=e)
        for r, e in enumerate(exits)
    ]
    for dog in dogs:
        dog.progress(0)
        dog.progress(1, step_done=True)
    start = time.monotonic()
    with dogs[1].phase("checkpoint save", 1, extra_s=4.0):  # 6 s allowed, then stalls
        with dogs[0].phase("validation", 1):  # 2 s allowed; its first batch waits on rank 1
            time.sleep(4.0)
            assert not any(e.done.is_set() for e in exits), "waiting on a save called a hang"
            assert exits[0].done.wait(timeout=10) or exits[1].done.wait(timeout=10)
    elapsed = time.monotonic() - start
    for dog in dogs:
        dog.stop()
    assert elapsed > 6.0, elapsed  # not before the save's own window ran out
    record = json.loads((tmp_path / "hang" / "hang.json").read_text())
    assert "checkpoint save after step 1" in record["reason"], record


def test_a_stopped_rank_cannot_hold_the_others_with_a_stale_long_window(tmp_path):
    """Rank 1's last heartbeat shows a long window (its first step, 60 s), then its thread
    stops beating, as a SIGSTOPped process's does. Rank 0, stalled in a 1 s window, must
    not wait those 60 s: the stale heartbeat vouches for nothing, and the hang is reported
    within a few seconds. (Found by the 2-node SLURM test: rank 1 was stopped right after a
    fast step, before its next beat.)"""
    from torch.distributed import HashStore

    store = HashStore()
    exits = [_Exits(), _Exits()]
    dogs = [
        HangWatchdog(tmp_path, 1.0, first, rank=r, world_size=2, store=store, exit_process=e)
        for r, (first, e) in enumerate(zip((1.0, 60.0), exits, strict=True))
    ]
    dogs[1].progress(0)  # rank 1: step 1, 60 s allowed; beats every 0.2 s
    time.sleep(0.5)
    dogs[1].stop()  # ... and beats no more
    start = time.monotonic()
    dogs[0].progress(0)  # rank 0: step 1, 1 s allowed, and no progress
    assert exits[0].done.wait(timeout=15), "a stale heartbeat held rank 0"
    dogs[0].stop()
    assert time.monotonic() - start < 10
    record = json.loads((tmp_path / "hang" / "hang.json").read_text())
    assert record["culprit_ranks"] == [1], record


class _CountingStore:
    """A real TCPStore client that forwards every call and notes the reads this rank made."""

    def __init__(self, store):
        self.store = store
        self.reads: list[tuple[str, list[str]]] = []  # (call, keys)

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def counted(*args, **kwargs):
            if name in ("get", "multi_get"):
                keys = args[0] if name == "multi_get" else [args[0]]
                self.reads.append((name, list(keys)))
            return call(*args, **kwargs)

        return counted


def test_one_rank_per_host_reads_the_heartbeats_with_one_request_per_read(tmp_path):
    """8 ranks on 2 hosts, every one alive and stalled in the same step (a collective that
    never returns), over one real TCPStore: each host's first detecting rank reads every
    heartbeat in one `multi_get` per read; the host's other ranks read none, dump their
    stacks under that reader's verdict and exit too; one hang.json. (At 1,024 ranks, 1,024
    ranks each reading 1,024 keys one at a time could outlast the collective timeout's
    60 s over the window: `_read_heartbeats`.)"""
    from datetime import timedelta

    from torch.distributed import TCPStore

    world = 8
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores = [
        _CountingStore(TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=30)))
        for _ in range(world)
    ]
    exits = [_Exits() for _ in range(world)]
    dogs = [
        HangWatchdog(tmp_path, 2.0, 2.0, rank=r, world_size=world, store=stores[r],
                     exit_process=exits[r], host=f"node{r // 4}")
        for r in range(world)
    ]  # fmt: skip
    for dog in dogs:
        dog.progress(0)  # step 1, 2 s allowed, and no progress after it
    for e in exits:
        assert e.done.wait(timeout=30), "a rank never followed the hang"
    for dog in dogs:
        dog.stop()
    assert all(e.codes == [ExitCode.HANG] for e in exits)
    heartbeat_keys = {f"watchdog/{r}" for r in range(world)}
    readers = []
    for rank, store in enumerate(stores):
        reads = [(call, keys) for call, keys in store.reads if heartbeat_keys & set(keys)]
        if reads:
            readers.append(rank)
            assert all(call == "multi_get" and len(keys) == world for call, keys in reads), reads
    assert len(readers) == 2 and {r // 4 for r in readers} == {0, 1}, readers
    record = json.loads((tmp_path / "hang" / "hang.json").read_text())
    assert record["detected_by"] in readers
    assert "all 8 ranks alive but none finished step 1" in record["reason"], record
    dumps = sorted((tmp_path / "hang").glob("*-step1-rank*.txt"))
    assert len(dumps) == world, dumps
    for dump in dumps:
        rank = int(dump.stem.rsplit("rank", 1)[1])
        text = dump.read_text()
        reader = next(r for r in readers if r // 4 == rank // 4)
        assert f"detected by rank {reader} after" in text.splitlines()[0], text[:500]


def test_save_bandwidth_must_be_positive():
    from tests.utils.runs import REPO
    from train.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"fault_tolerance.min_save_gb_per_s = 0.0 must be positive"
    ):
        load_config(REPO / "configs" / "debug.toml", [("fault_tolerance.min_save_gb_per_s", 0)])
    run = load_config(REPO / "configs" / "debug.toml")
    assert run.fault_tolerance.min_save_gb_per_s == 0.5


# --------------------------------------------------------------------------- micro-batches


class _FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_step_of_8_micro_batches_beats_per_micro_batch_and_a_stalled_one_is_named(tmp_path):
    """Issue 26: a 128K step (8 micro-batches of ~11 s on 64 H100s) outlasts one whole-step
    window. With a beat per micro-batch, 8 micro-batches of 0.2 x the window each (1.6
    windows in all) pass; a micro-batch that stalls past its window is named with the
    rank, the step and the micro-batch. A fake clock: nothing waits."""
    clock, exits = _FakeClock(), _Exits()
    dog = HangWatchdog(
        tmp_path, HANG_S, FIRST_S, rank=0, world_size=1, exit_process=exits, clock=clock
    )
    dog.progress(0)
    dog.micro_batch(1, seq_len=131072)  # the first step after a start compiles
    assert _allowed(dog) == ("step 1, micro-batch 1, seq_len 131072", FIRST_S)
    dog.progress(4)  # a later step: no compile
    for index in range(1, 9):
        dog.micro_batch(index, seq_len=131072)
        assert _allowed(dog) == (f"step 5, micro-batch {index}, seq_len 131072", HANG_S)
        clock.now += 0.2 * HANG_S
        assert not dog.check(), f"micro-batch {index} of a progressing step called a hang"
    dog.progress(5)
    dog.micro_batch(1, seq_len=131072)
    dog.micro_batch(2, seq_len=131072)
    clock.now += 1.5 * HANG_S  # micro-batch 2 of step 6 never ends
    assert dog.check()
    dog.stop()
    assert exits.codes == [ExitCode.HANG]
    record = json.loads((tmp_path / "hang" / "hang.json").read_text())
    assert record["where"] == "step 6, micro-batch 2, seq_len 131072", record
    assert record["step"] == 6 and record["culprit_ranks"] == [0], record
    assert record["stalled_s"] == pytest.approx(1.5 * HANG_S), record
    assert "rank 0" in record["reason"], record


def test_micro_batch_windows_come_from_the_plan_with_compile_at_a_start_and_a_new_seq_len(
    tmp_path,
):
    """The planned times of the long-context stage on 64 H100s (train/reliability/budgets.py): the
    128K micro-batch (88.4 s / 8) fits its window; the first micro-batch after a start and
    at a new seq_len gets the compile time on top; the configured keys are floors."""
    from train.reliability.budgets import STEP_MARGIN, Budgets, PlannedTimes

    planned = PlannedTimes(
        fingerprint="x", world_size=64, gpu="H100", accumulation=8,
        step_s={8192: 10.5, 131072: 88.4}, compile_s=120.0, checkpoint_bytes=96_400_000_000,
        storage_gb_per_s=5.0, save_s=19.3,
    )  # fmt: skip
    budgets = Budgets(hang_timeout_s=20.0, first_step_timeout_s=60.0, train_timeout_s=100.0,
                      planned=planned)  # fmt: skip
    dog = HangWatchdog(tmp_path, 20.0, 60.0, rank=0, world_size=1, budgets=budgets)
    dog.progress(0)
    dog.micro_batch(1, 8192)  # the first step compiles
    assert _allowed(dog)[1] == pytest.approx(max(60.0, 20.0 + 120.0))
    dog.micro_batch(2, 8192)
    assert _allowed(dog)[1] == 20.0  # the floor: 3 x 1.3 s is less
    dog.progress(1)
    dog.new_shape("seq_len 131072")
    dog.micro_batch(1, 131072)
    window_128k = STEP_MARGIN * 88.4 / 8
    assert _allowed(dog)[1] == pytest.approx(window_128k + 120.0)
    dog.micro_batch(2, 131072)
    assert _allowed(dog)[1] == pytest.approx(window_128k)
    assert 88.4 / 8 < window_128k  # the 128K micro-batch fits its window
    dog.stop()
