"""The data ledger in-process: the real loader and the real recorder (train/ledger/recorder.py)
driven step by step on one rank, then `python -m train.ledger verify` run as a user
runs it (a fresh process: no patch of this one reaches it).

- a loader bug injected in one step, a skipped window or a repeated one, fails
  verification at that step and only there (the record is judged on its own, later steps
  from the recorded position); the same run without the bug verifies;
- a kill mid-append tears the last line; the resumed run's writer ends that line, chains
  on from the last whole record, and the ledger verifies with the torn line reported
  (and counted by `coverage`);
- a resume with a quarantined document in force (what `python -m train.forensics
  --quarantine-top` leaves for it) verifies, `which` plans its steps without the document,
  and with the quarantine record gone from RUN/incidents.jsonl `verify` fails at that
  resume, saying so;
- the row digest does not depend on how rows are dealt to ranks.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading

import pytest

import train.ledger.__main__ as ledger_command
from common.io import append_jsonl
from common.run_layout import CONFIG, INCIDENTS, LEDGER, QUARANTINE_KIND
from dataloader import MixEntry, TokenShardDataLoader
from dataloader.incidents import read_incidents
from dataloader.ledger_record import NUM_LANES, add_rows
from dataloader.stream import DatasetStream
from tests.utils.runs import REPO, train_env
from train.ledger.readers import coverage, which
from train.ledger.recorder import DataLedgerRecorder

LOCAL_BATCH, ACCUMULATION = 2, 2  # 4 sequences a step
BUGGY_STEP = 4


def build_loader(train):
    config = TokenShardDataLoader.Config(
        mix=[MixEntry(str(train))], seed=5, prefetch=0, block_tokens=2048, shuffle_blocks=4
    )
    return config.build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=LOCAL_BATCH)


def recorder_for(loader, run_dir) -> DataLedgerRecorder:
    """The recorder as `RunTrainer` builds it."""
    return DataLedgerRecorder(
        loader,
        run_folder=run_dir,
        micro_batches=ACCUMULATION,
        fresh=False,
    )


def train_steps(loader, recorder, steps) -> None:
    """One launch: what torchtitan's train_step does with the loader, then RunTrainer's
    ledger line, each step; then the trainer's close (the writer thread's last fsync)."""
    for step in steps:
        for _ in range(ACCUMULATION):
            next(loader)
        recorder.after_step(step, skipped=False)
    recorder.close()


def verify(run_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "train.ledger", "verify", str(run_dir)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("bug", [None, "skipped window", "repeated window"])
def test_a_loader_bug_fails_verification_at_its_step(shakespeare_data, tmp_path, monkeypatch, bug):
    loader = build_loader(shakespeare_data / "train")
    advance = DatasetStream.advance
    first_of_buggy_step = (BUGGY_STEP - 1) * LOCAL_BATCH * ACCUMULATION

    def buggy_advance(self, position, seq_len, count, starts=None):
        if starts is None or loader.cursor.num_sequences != first_of_buggy_step:
            return advance(self, position, seq_len, count, starts)
        if bug == "skipped window":  # one window drawn and given to no one
            position = advance(self, position, seq_len, 1)
            return advance(self, position, seq_len, count, starts)
        position = advance(self, position, seq_len, count, starts)
        starts[-1] = starts[0]  # the first window twice, the last never
        return position

    if bug:
        monkeypatch.setattr(DatasetStream, "advance", buggy_advance)
    train_steps(loader, recorder_for(loader, tmp_path), range(1, 7))
    proc = verify(tmp_path)
    lines = proc.stdout.splitlines()
    if bug is None:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert lines[-1].startswith("OK: steps 1-6 verified")
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines[-1].startswith(f"FAILED: first bad step: step {BUGGY_STEP}: ")
    bad = [line for line in lines if line.startswith("MISMATCH")]
    assert bad and all(f"step {BUGGY_STEP}:" in line for line in bad), proc.stdout
    if bug == "repeated window":  # the rows differ, the position does not
        assert [b.split(": ", 1)[1] for b in bad] == [
            "the rows the ranks trained differ from the order's (a window missing, repeated "
            "or read from elsewhere)"
        ]
    else:
        assert any("position after the step" in b for b in bad)


def test_a_torn_last_line_is_ended_and_the_resume_chains_on(shakespeare_data, tmp_path):
    loader = build_loader(shakespeare_data / "train")
    train_steps(loader, recorder_for(loader, tmp_path), range(1, 4))
    state = loader.state_dict()
    with open(tmp_path / LEDGER, "a") as fh:  # a kill in the middle of step 4's append
        fh.write('{"kind": "step", "step": 4, "applied": tr')
    resumed = build_loader(shakespeare_data / "train")
    resumed.load_state_dict(state)
    recorder = recorder_for(resumed, tmp_path)
    recorder.on_load(3)  # what RunTrainer.load_state_dict does at a resume
    train_steps(resumed, recorder, range(4, 6))
    proc = verify(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "line 5 is torn (a kill mid-append)" in proc.stdout
    assert "(resume from step 3;" in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("OK: steps 1-5 verified")
    assert coverage(tmp_path)["torn_lines"] == 1  # coverage said nothing of it


def test_a_quarantine_in_force_verifies_and_needs_its_record(shakespeare_data, tmp_path):
    train = shakespeare_data / "train"
    loader = build_loader(train)
    train_steps(loader, recorder_for(loader, tmp_path), range(1, 4))
    state = loader.state_dict()
    probe = build_loader(train)  # the document under a window step 5 would train
    probe.load_state_dict(state)
    for _ in range(2 * ACCUMULATION):
        next(probe)
    dataset, _, start = probe.last_origins[0]
    document, first, end = next(iter(probe.datasets[dataset].documents_between(start, start + 1)))
    content = probe.fingerprint_parts[dataset]["content_sha256"]
    quarantine = {"kind": QUARANTINE_KIND, "content_sha256": content, "tokens": [first, end]}
    append_jsonl(tmp_path / INCIDENTS, {**quarantine, "document": document})
    resumed = build_loader(train)
    resumed.load_state_dict(state)
    # what the resume does (train/reliability/rollback.py): the same reader and rule verify applies
    assert resumed.add_quarantine(read_incidents(tmp_path).quarantine_entries()) == 1
    recorder = recorder_for(resumed, tmp_path)
    recorder.on_load(3)
    train_steps(resumed, recorder, range(4, 8))
    assert resumed.quarantined_windows > 0  # the quarantine changed what was trained

    report = io.StringIO()
    assert ledger_command.verify(tmp_path, report) == 0, report.getvalue()
    _, rows = which(tmp_path, 5)
    assert rows and not any(
        r.dataset == dataset and r.start < end and first < r.start + r.seq_len + 1 for r in rows
    )

    (tmp_path / INCIDENTS).write_text("")  # the quarantine record dropped
    report = io.StringIO()
    assert ledger_command.verify(tmp_path, report) == 1
    assert report.getvalue().splitlines()[-1] == (
        "FAILED: first bad step: step 4: the loader ran with 1 quarantined document(s) in "
        f"force, but {INCIDENTS} holds 0 quarantine record(s) (a record removed since?)"
    )


def test_the_ledger_is_fsynced_by_its_writer_thread_every_n_steps_and_at_a_checkpoint(
    shakespeare_data, tmp_path, monkeypatch
):
    """Rank 0's training thread hands records over and never fsyncs; the writer thread
    fsyncs every `fsync_every` steps and at each checkpoint save, and the file verifies."""
    fsynced = []  # (thread, the ledger's step records on disk at that fsync)
    real_fsync = os.fsync

    def watched_fsync(fd):
        on_disk = (tmp_path / LEDGER).read_text().count('"kind": "step"')
        fsynced.append((threading.current_thread().name, on_disk))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", watched_fsync)
    loader = build_loader(shakespeare_data / "train")
    recorder = DataLedgerRecorder(
        loader,
        run_folder=tmp_path,
        micro_batches=ACCUMULATION,
        fresh=False,
        fsync_every=4,
    )
    for step in range(1, 11):
        for _ in range(ACCUMULATION):
            next(loader)
        recorder.after_step(step, skipped=False)
        if step == 6:  # what the checkpointer's before_save hook does for a save of step 6
            recorder.sync()
            assert fsynced[-1] == ("ledger-writer", 6)  # every record up to it on disk
    recorder.close()
    assert fsynced == [
        ("ledger-writer", 4),
        ("ledger-writer", 6),  # the checkpoint
        ("ledger-writer", 10),  # 4 steps after it
        ("ledger-writer", 10),  # the close
    ], fsynced
    monkeypatch.undo()
    report = io.StringIO()
    assert ledger_command.verify(tmp_path, report) == 0, report.getvalue()


# `python -m train.ledger verify RUN` as a user runs it, reporting whether torch was imported
TORCH_FREE_VERIFY = """
import runpy, sys
sys.argv = ["train.ledger", "verify", sys.argv[1]]
try:
    runpy.run_module("train.ledger", run_name="__main__")
except SystemExit as exit:
    print(f"exit {exit.code}")
print("TORCH" if "torch" in sys.modules else "NO-TORCH")
"""


def test_verify_reads_the_run_config_through_train_config_and_imports_no_torch(
    shakespeare_data, tmp_path
):
    """The verifier reads RUN/config.toml with the trainer's own reader (its defaults, no
    copy of them), and `python -m train.ledger` stays torch-free (an auditor's machine)."""
    from train.config import RunConfig, save_config

    train = shakespeare_data / "train"
    loader = build_loader(train)
    train_steps(loader, recorder_for(loader, tmp_path), range(1, 4))
    run = RunConfig()  # the defaults, then the loader's settings of build_loader
    run.dataloader.mix = [MixEntry(str(train))]
    run.dataloader.seed, run.dataloader.block_tokens, run.dataloader.shuffle_blocks = 5, 2048, 4
    run.training.seq_len, run.training.local_batch_size = 64, LOCAL_BATCH
    run.validation.enable = False
    save_config(run, tmp_path / CONFIG)
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_VERIFY, str(tmp_path)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"{CONFIG} matches the last segment's loader parameters" in proc.stdout, proc.stdout
    assert lines[-3].startswith("OK: steps 1-3 verified"), proc.stdout
    assert lines[-2:] == ["exit 0", "NO-TORCH"]

    run.dataloader.seed = 6  # a config that no longer says what the run trained with
    save_config(run, tmp_path / CONFIG)
    report = io.StringIO()
    assert ledger_command.verify(tmp_path, report) == 1
    assert "differs from what the last segment ran with in ['seed']" in report.getvalue()


def test_the_row_digest_does_not_depend_on_how_rows_are_dealt():
    rows = [(d % 2, 1000 + 64 * n, 0, n) for d, n in enumerate(range(12))]

    def lanes(*plans):
        out = [0] * NUM_LANES
        for plan in plans:
            add_rows(out, plan, 64)
        return out

    whole = lanes(rows)
    assert whole == lanes(rows[::-1]) == lanes(rows[:5], rows[5:9], rows[9:])  # 3 ranks
    assert whole[:2] == [12, 12 * 64]
    moved = [*rows[:-1], (rows[-1][0], rows[-1][1] + 1, 0, rows[-1][3])]  # one start off by 1
    assert lanes(moved)[:2] == whole[:2] and lanes(moved)[2:] != whole[2:]
