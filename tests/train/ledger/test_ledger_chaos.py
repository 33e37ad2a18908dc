"""The data ledger of a real run through everything that threatens exact-once data: a
kill -9 after a checkpoint, a resize 2 -> 3 -> 1, a loss-spike rollback and seq_len
changes (the chaos run, tests/utils/chaos.py; built once per session).

- its ledger verifies, recomputed by `python -m train.ledger verify` from the config,
  the manifests and the incidents alone, with the killed and the rolled-back steps reported
  as superseded;
- coverage finds no token trained twice, and skipped counts equal to the loader's own
  counters as the trainer logged them;
- `which` names each row's source file and record, and the poisoned documents under the
  rolled-back step;
- a tampered copy of the ledger fails verification, naming the step, whether or not the
  tamperer rewrote the hash chain; so does one whose tail was cut (its last line, or every
  step line after the last resume), behind the run's newest complete checkpoint;
- the README's ledger commands run as written on it;
- the trainer's side of the kill -9: the restart skips a torn save (a step folder without
  `.metadata`, what a kill in the middle of a save leaves) and resumes from the newest
  complete checkpoint, so at most one checkpoint interval of work is lost.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from common.run_layout import CONFIG, INCIDENTS, LEDGER
from tests.utils.chaos import TORN_STEP
from tests.utils.runs import REPO, complete_steps, read_metrics, train_env

pytestmark = pytest.mark.slow


def ledger(*args: str) -> subprocess.CompletedProcess:
    """`python -m train.ledger ARGS` (torch-free) as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "train.ledger", *map(str, args)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_chaos_run_ledger_verifies_with_its_lineage(chaos_run):
    print(f"chaos run: {chaos_run.seconds:.1f} s")  # the scenario's cost (-s shows it)
    proc = ledger("verify", chaos_run.run_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    segments = [line for line in lines if re.search(r"^ok .* segment \d+ \(", line)]
    assert [
        re.search(r"\((start|resume from step \d+|rollback to step \d+);", s).group(1)
        for s in segments
    ] == [
        "start",
        "resume from step 3",
        "rollback to step 6",
        "resume from step 9",
    ]
    assert [re.search(r"(\d+) rank", s).group(1) for s in segments] == ["2", "3", "3", "1"]
    # step 4 (trained before the kill, after checkpoint 3) and steps 7-8 (rolled back)
    assert any(
        line.startswith("superseded") and "3 record(s) of steps 4, 7-8" in line for line in lines
    ), proc.stdout
    assert lines[-1].startswith("OK: steps 1-12 verified (12 in the final lineage")
    # one chain, and the resumes continued it
    records = [json.loads(line) for line in (chaos_run.run_dir / LEDGER).read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == [
        *range(1, 5),  # launch 1, killed in step 5
        *range(4, 9),  # launch 2 from checkpoint 3, the spike at 8
        7,
        8,
        9,  # after the rollback to 6
        10,
        11,
        12,  # launch 3
    ]
    spike = [r for r in records if r["kind"] == "step" and not r["applied"]]
    assert [r["step"] for r in spike] == [8]  # the spike's update was not applied
    lengths = {r["step"]: r["tokens"] // r["rows"] for r in records if r["kind"] == "step"}
    assert (lengths[5], lengths[6], lengths[10]) == (32, 64, 48)


def test_chaos_run_coverage_trains_nothing_twice_and_counts_what_the_loader_skipped(chaos_run):
    proc = ledger("coverage", chaos_run.run_dir, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (dataset,) = json.loads(proc.stdout)["datasets"]
    assert dataset["trained_twice"] == 0
    # the rollback's skip range: [36, 48) at seq_len 64, drawn by the rolled-back steps
    assert chaos_run.incident["skipped_sequences"] == [36, 48]
    assert (dataset["skipped_sequences"], dataset["skipped_ranges"]) == (12, 12 * 64)
    last = [r for r in read_metrics(chaos_run.run_dir, "train") if r["step"] == 12][-1]
    assert dataset["skipped_sequences"] == last["data_skipped_sequences"]
    assert dataset["skipped_cuts_and_tails"] == last["data_skipped_tokens"] > 0  # two cuts
    # trained tokens: 12 steps of 6 rows at 32 (1-5), 64 (6-9) and 48 (10-12) tokens
    assert dataset["trained_once"] == 6 * (5 * 32 + 4 * 64 + 3 * 48)
    total = dataset["input_tokens_per_epoch"] * dataset["epochs"]
    counted = sum(dataset[k] for k in ("trained_once", "skipped_ranges", "skipped_cuts_and_tails"))
    assert dataset["not_reached"] == total - counted > 0


def test_which_names_sources_and_records_and_the_poisoned_documents(chaos_run):
    proc = ledger("which", chaos_run.run_dir, "--step", 8, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    # step 8 after the rollback: step 7 took the six sequences after the skip range [36, 48)
    assert [r["sequence"] for r in rows] == list(range(54, 60))
    texts = {
        str(path): path.read_text().splitlines()
        for path in (chaos_run.data.parent / "raw").iterdir()
    }
    for row in rows:
        assert row["seq_len"] == 64 and row["documents"]
        for doc in row["documents"]:
            # the record's text, one token per character, is the document (BOS + text + EOS)
            text = json.loads(texts[doc["source"]][doc["record"]])["text"]
            assert doc["end"] - doc["start"] == len(text) + 2
    # the poisoned documents lie under the spiked sequences, named by file and line
    spiked = set(range(chaos_run.spiked_sequences[0], chaos_run.spiked_sequences[1] + 1))
    assert {p.sequence for p in chaos_run.poisoned} <= spiked
    for p in chaos_run.poisoned:
        text = json.loads(texts[p.source][p.record])["text"]
        assert len(set(text)) == 1 if p.kind == "repeat" else len(set(text)) > 20


def test_tampered_ledger_fails_naming_the_step(chaos_run, tmp_path):
    from dataloader.ledger_record import chain_hash

    def copy(name: str):
        run = tmp_path / name
        run.mkdir()
        for part in (CONFIG, INCIDENTS):
            shutil.copy(chaos_run.run_dir / part, run / part)
        lines = (chaos_run.run_dir / LEDGER).read_text().splitlines()
        return run, [json.loads(line) for line in lines]

    def write(run, records):
        (run / LEDGER).write_text("".join(json.dumps(r) + "\n" for r in records))

    # 1. a row digest changed in place: the chain breaks at that record
    run, records = copy("edited")
    target = next(r for r in records if r.get("step") == 10)
    target["digest"][0] ^= 1
    write(run, records)
    proc = ledger("verify", run)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1].startswith("FAILED: first bad step: step 10: line ")
    assert "chain hash broken" in proc.stdout

    # 2. the same edit with the whole chain rewritten: the recomputation still catches it
    run, records = copy("rechained")
    next(r for r in records if r.get("step") == 10)["digest"][0] ^= 1
    previous = "0" * 64
    for record in records:
        record["chain"] = previous = chain_hash(previous, record)
    write(run, records)
    proc = ledger("verify", run)
    assert proc.returncode == 1 and "chain hash broken" not in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("FAILED: first bad step: step 10: the rows")

    # 3. a step record removed (the rolled-back step 7, re-chained): the lineage breaks there
    run, records = copy("removed")
    drop = [i for i, r in enumerate(records) if r.get("step") == 7][-1]
    records = records[:drop] + records[drop + 1 :]
    previous = "0" * 64
    for record in records:
        record["chain"] = previous = chain_hash(previous, record)
    write(run, records)
    proc = ledger("verify", run)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1].startswith("FAILED: first bad step: step 8: line ")

    # 4. the tail cut: the last line deleted (the chain of what is left still holds), or
    # every step line after the last resume; the run's checkpoints are there (step-12 last)
    resumed = [i for i, r in enumerate(copy("x")[1]) if r.get("cause") == "resume"][-1]
    for name, keep, last in (("cut-last", -1, 11), ("cut-after-resume", resumed + 1, 9)):
        run, records = copy(name)
        (run / "checkpoint").symlink_to(chaos_run.run_dir / "checkpoint")
        write(run, records[:keep])
        proc = ledger("verify", run)
        assert proc.returncode == 1, proc.stdout
        assert proc.stdout.splitlines()[-1] == (
            f"FAILED: first bad step: step {last + 1}: checkpoint {run / 'checkpoint' / 'step-12'} "
            f"is complete, but the final lineage ends at step {last}: the ledger's tail was cut "
            f"(the records of steps {last + 1}-12 deleted or lost), so that checkpoint's data "
            "cannot be vouched for"
        ), proc.stdout


def test_readme_ledger_commands(chaos_run):
    """The README's ledger commands (section "The data ledger"), on the chaos run."""
    run = chaos_run.run_dir
    verified = ledger("verify", run)
    assert verified.returncode == 0 and verified.stdout.splitlines()[-1].startswith("OK: ")
    which = ledger("which", run, "--step", 5)
    assert which.returncode == 0, which.stderr
    assert which.stdout.startswith("step 5: 6 rows of 32 tokens")
    assert len(re.findall(r"part\d\.jsonl record \d+", which.stdout)) >= 6
    covered = ledger("coverage", run)
    assert covered.returncode == 0 and "trained twice         0" in covered.stdout


def test_kill_9_restart_skips_a_torn_save_and_resumes_from_the_newest_complete_checkpoint(
    chaos_run,
):
    checkpoints = chaos_run.run_dir / "checkpoint"
    restarted = chaos_run.outputs[1]
    # launch 1 was killed inside step 5 (steps 1-4 in its ledger, the first test's); the
    # restart loads checkpoint 3 past the torn step-4: one step of work lost, < an interval
    assert f"Skipping incomplete checkpoint {checkpoints / f'step-{TORN_STEP}'}" in restarted
    assert f"Loading the checkpoint from {checkpoints / f'step-{TORN_STEP - 1}'}" in restarted
    assert f"Training starts at step {TORN_STEP}" in restarted, restarted[-3000:]
    # the torn folder was never loaded nor counted; the run went on to its last step
    assert complete_steps(chaos_run.run_dir) == [3, 6, 9, 12]
