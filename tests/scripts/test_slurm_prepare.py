"""Distributed `dataloader.prepare` on a real one-node SLURM cluster (tests/scripts/conftest.py).

`scripts/slurm/submit_prepare.py` submits `prepare.sbatch` as a 4-task array plus a
merge that waits on it, exactly as a user would. One task is killed mid-run with
`scancel` of its array element: its last input is a named pipe nobody writes to, so
the task has finished its first work unit and then blocks, holding a CPU like a real
slow task, until it is cancelled. SLURM must then drop the merge; a resubmission with
the same arguments must run only that task (its finished shards kept) and the merge.
The merged dataset must be byte-identical to a single-process prepare of the same
inputs: same documents, tokens, order, shard files and `content_sha256`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataloader.corpus import iter_documents
from dataloader.manifest import Manifest
from dataloader.prepare import PrepareConfig, prepare
from dataloader.prepare.plan import marker_path
from tests.utils.runs import REPO, train_env

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.e2e]

SUBMIT = REPO / "scripts" / "slurm" / "submit_prepare.py"
NUM_TASKS = 4
SHARD_CHARS = 40_000  # each input file (~60 KB) is its own work unit, split into 2 chunks


def write_corpus(root: Path) -> tuple[list[Path], bytes]:
    """Five jsonl files of Shakespeare scenes; the last one is returned as bytes to be
    written later (its path is a named pipe for now). Five units over four tasks: task 0
    gets units 0 and 4."""
    root.mkdir(parents=True)
    scenes = [d.text for d in iter_documents(["shakespeare"]) if d.text.strip()]
    files, contents = [], []
    for i in range(5):
        lines = [json.dumps({"text": t[:4000]}) for t in scenes[i * 20 : (i + 1) * 20]]
        contents.append(("\n".join(lines) + "\n").encode())
        files.append(root / f"part{i}.jsonl")
        assert len(contents[-1]) > SHARD_CHARS
    for path, data in zip(files[:-1], contents[:-1], strict=True):
        path.write_bytes(data)
    os.mkfifo(files[-1])
    return files, contents[-1]


def submit(cluster, args: list[str]) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            str(SUBMIT),
            "--num-tasks",
            str(NUM_TASKS),
            "--cpus-per-task",
            "1",
            "--time",
            "10:00",
            *args,
        ],
        env=cluster.env | train_env() | {"SLURM_CONF": cluster.env["SLURM_CONF"]},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def wait_until(predicate, timeout: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs()}"
        time.sleep(0.5)


def test_array_prepare_survives_a_killed_task_and_matches_single_process(
    slurm_cluster, shakespeare_data, tmp_path
):
    files, last_file = write_corpus(tmp_path / "raw")
    data = tmp_path / "data"
    args = [a for f in files for a in ("--input", str(f))]
    args += [
        "--tokenizer",
        str(shakespeare_data / "tokenizer"),
        "--val-fraction",
        "0.1",
        "--shard-chars",
        str(SHARD_CHARS),
        "--out",
        str(data),
    ]
    logs_dir = data / "prepare_logs"

    def logs() -> str:
        parts = [f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs_dir.glob("*.log"))]
        return "\n".join(parts) + "\n" + slurm_cluster.logs()

    first = submit(slurm_cluster, args)
    assert first["tasks"] == [0, 1, 2, 3] and first["tokenizer"] is None
    markers = [marker_path(data, i, NUM_TASKS) for i in range(NUM_TASKS)]
    # Task 0 finishes unit 0, then blocks on the pipe (unit 4); tasks 1-3 complete.
    wait_until(
        lambda: (
            all(m.exists() for m in markers[1:])
            and list((data / "train" / "shards").glob("000000-*.json"))
        ),
        240,
        "tasks 1-3 to finish and task 0 to finish its first unit",
        logs,
    )
    assert not markers[0].exists()
    slurm_cluster.run("scancel", f"{first['array']}_0")
    merge_state = slurm_cluster.wait_job(first["merge"], timeout=120)
    assert merge_state["JobState"] == "CANCELLED", merge_state  # --kill-on-invalid-dep
    assert not (data / "train" / "manifest.json").exists()

    done_before = {p: p.stat().st_mtime_ns for p in (data / "train" / "shards").iterdir()}
    done_before |= {m: m.stat().st_mtime_ns for m in markers[1:]}
    files[-1].unlink()
    files[-1].write_bytes(last_file)

    second = submit(slurm_cluster, args)
    assert second["tasks"] == [0], second  # only the killed task runs again
    state = slurm_cluster.wait_job(second["merge"], timeout=240)
    assert state["JobState"] == "COMPLETED", f"{state}\n{logs()}"
    task_logs = sorted(p.name for p in logs_dir.glob(f"*-task-{second['array']}_*.log"))
    assert task_logs == [f"prepare-data-task-{second['array']}_0.log"], task_logs
    rerun_log = (logs_dir / task_logs[0]).read_text()
    kept = re.search(r"\((\d+) kept from an earlier run\)", rerun_log)
    assert kept and int(kept.group(1)) > 0, rerun_log  # unit 0's shards were not redone
    for path, mtime in done_before.items():  # nothing finished was rewritten
        assert path.stat().st_mtime_ns == mtime, f"{path} was rewritten"

    reference = tmp_path / "reference"
    single = prepare(
        PrepareConfig(
            inputs=[str(f) for f in files],
            out=reference,
            tokenizer=str(shakespeare_data / "tokenizer"),
            val_fraction=0.1,
            shard_chars=SHARD_CHARS,
            num_workers=1,
            progress=False,
        )
    )
    assert len(Manifest.load(data / "train").shards) > NUM_TASKS
    for split in ("train", "val"):
        merged = Manifest.load(data / split, verify=True)
        assert merged.content_sha256 == single[split].content_sha256
        assert merged.num_documents > 0 and merged.num_tokens == single[split].num_tokens
        # Same documents, tokens and order: the index and every shard are the same bytes.
        assert (data / split / "manifest.json").read_bytes() == (
            reference / split / "manifest.json"
        ).read_bytes()
        assert (data / split / "documents.npy").read_bytes() == (
            reference / split / "documents.npy"
        ).read_bytes()
        for shard in merged.shards:
            assert (data / split / shard.file).read_bytes() == (
                reference / split / shard.file
            ).read_bytes()
