"""The RUN/ folder contract: what a training run leaves behind, and where.

    RUN/config.toml            the fully resolved config (train writes it, export/eval read it)
    RUN/checkpoint/step-N/     torchtitan's CheckpointManager layout: DCP, or an HF save
    RUN/metrics.jsonl          one JSON line per logged step (train/components/metrics.py)
    RUN/rank_times.jsonl       per-rank step times per interval (train/reliability/health.py)
    RUN/fp8_stats.jsonl        FP8 numerics per linear on each fp8.stats_freq step (train/components/fp8_stats.py)
    RUN/preempted.json         the step a preempted run saved at; removed when it resumes
    RUN/diverged.json          why a run stopped on non-finite steps (no requeue)
    RUN/incidents.jsonl        loss-spike rollbacks: the spike, the checkpoint gone back to,
                               the data skipped (one JSON line each;
                               train/reliability/rollback.py); and quarantined documents
                               (python -m train.forensics --quarantine-*)
    RUN/ledger.jsonl           the data ledger: per optimizer step a chained record of the
                               rows trained and the data skipped (train/ledger/)
    RUN/forensics/incident-K.json   spike forensics of incident K: the spiking step replayed,
                               its documents ranked by loss, FP8 statistics (train/forensics/)
    RUN/forensics/incident-K/  that replay's own run folder (metrics.jsonl of the replayed
                               steps, the incidents in force before K)
    RUN/hang/                  the hang watchdog's stack dumps and verdict
    RUN/lease.json             who is running on this folder now: host, pid, SLURM job,
                               last heartbeat (one live run per folder; common/run_lease.py)
    RUN/budgets.json           the plan's predicted times (--dry-run --write-budgets)
    RUN/save_rate.json         the last checkpoint save as the run measured it: its bytes,
                               seconds, GB/s (train/components/save_window.py writes it,
                               train/reliability/budgets.py reads it)
    RUN/tb/                    TensorBoard scalars (train and eval)
    RUN/replicas/G/            replica group G's own files when torchft replica groups train
                               the run (train/replica_groups/): its ledger.jsonl (the
                               quorum, slices and commit of each step), metrics.jsonl, tb/
    RUN/lighthouse.json        the torchft Lighthouse's address and the groups' launch
    RUN/eval/step-N/           eval.watch's results; RUN/eval/hf/step-N its exports

Every package spells these names through this module, and asks it, and only it, whether a
checkpoint is complete.
"""

from __future__ import annotations

import re
from pathlib import Path

from common.io import read_jsonl

CONFIG = "config.toml"
CHECKPOINT_DIR = "checkpoint"
METRICS = "metrics.jsonl"
RANK_TIMES = "rank_times.jsonl"
FP8_STATS = "fp8_stats.jsonl"
PREEMPTED = "preempted.json"
DIVERGED = "diverged.json"
INCIDENTS = "incidents.jsonl"
LEDGER = "ledger.jsonl"
HANG_DIR = "hang"
LEASE = "lease.json"
# the plan's predicted times, for the budgets (train/reliability/budgets.py)
BUDGETS = "budgets.json"
SAVE_RATE = "save_rate.json"  # the last save as measured (train/components/save_window.py)
# the kinds of RUN/incidents.jsonl records
SPIKE_KIND = "loss_spike"  # a rollback (train/reliability/rollback.py)
QUARANTINE_KIND = "quarantine"  # a document never trained again (train/forensics/)
FORENSICS_DIR = "forensics"
TB_DIR = "tb"
EVAL_DIR = "eval"
REPLICAS_DIR = "replicas"
LIGHTHOUSE = "lighthouse.json"

# torchtitan's CheckpointManager writes RUN/checkpoint/step-N
STEP_DIR_PATTERN = re.compile(r"^step-(\d+)$")
# DCP writes it last, after every rank's shards: its presence means the save finished
DCP_METADATA = ".metadata"
# what torchtitan's HF-format (last_save_in_hf) save writes last
HF_INDEX = "model.safetensors.index.json"


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def parse_step_dir(name: str) -> int | None:
    """N for a folder named `step-N`, else None."""
    match = STEP_DIR_PATTERN.match(name)
    return int(match.group(1)) if match else None


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """RUN/checkpoint/step-N."""
    return Path(run_dir) / CHECKPOINT_DIR / step_dir_name(step)


def replica_dir(run_dir: str | Path, group: int) -> Path:
    """RUN/replicas/G: replica group G's ledger, metrics and TensorBoard folder."""
    return Path(run_dir) / REPLICAS_DIR / str(group)


def replica_groups(run_dir: str | Path) -> list[int]:
    """The groups that have a RUN/replicas/G folder, sorted (none: not a replica run)."""
    folder = Path(run_dir) / REPLICAS_DIR
    if not folder.is_dir():
        return []
    return sorted(int(c.name) for c in folder.iterdir() if c.is_dir() and c.name.isdigit())


def forensics_report(run_dir: str | Path, incident: int) -> Path:
    """RUN/forensics/incident-K.json: `python -m train.forensics RUN --incident K`'s report."""
    return Path(run_dir) / FORENSICS_DIR / f"incident-{incident}.json"


def forensics_replay_dir(run_dir: str | Path, incident: int) -> Path:
    """RUN/forensics/incident-K/: the folder the forensics replay of incident K runs in."""
    return Path(run_dir) / FORENSICS_DIR / f"incident-{incident}"


def is_complete_checkpoint(step_dir: str | Path, *, dcp_only: bool = False) -> bool:
    """Whether a step-N folder holds a finished save: DCP's `.metadata`, or (unless
    `dcp_only`: only DCP can be exported) the index of torchtitan's HF-format save, which
    the trainer can resume from."""
    step_dir = Path(step_dir)
    if (step_dir / DCP_METADATA).is_file():
        return True
    return not dcp_only and (step_dir / HF_INDEX).is_file()


def list_checkpoints(folder: str | Path, *, dcp_only: bool = False) -> tuple[list[int], list[int]]:
    """(complete steps, incomplete steps) of the step-N folders in a checkpoint folder
    (RUN/checkpoint), each sorted; a missing folder has none."""
    folder = Path(folder)
    complete, incomplete = [], []
    if folder.is_dir():
        for child in folder.iterdir():
            step = parse_step_dir(child.name)
            if step is not None and child.is_dir():
                done = is_complete_checkpoint(child, dcp_only=dcp_only)
                (complete if done else incomplete).append(step)
    return sorted(complete), sorted(incomplete)


def read_metrics(run_dir: str | Path) -> tuple[list[dict], int]:
    """(RUN/metrics.jsonl's records in file order, how many torn lines were skipped).

    A resumed run logs again the steps after its checkpoint, so a step can appear twice:
    the later line is the one that counts. A line torn by a kill mid-write is skipped and
    counted (the resume re-logs its step). A ValueError when the file is missing."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise ValueError(f"{path} does not exist: is {run_dir} a training run folder?")
    return read_jsonl(path)


def unresolved_rollbacks(run_dir: str | Path) -> dict[int, int]:
    """{checkpoint step: incident K} for each loss-spike incident of RUN/incidents.jsonl
    (numbered 1, 2, ... in file order, as `python -m train.forensics --incident K` counts
    them) that has no forensics report yet: its replay starts from that checkpoint, so
    `checkpoint.keep_last` must not purge it (train/components/checkpoint.py). The report,
    RUN/forensics/incident-K.json, resolves it."""
    path = Path(run_dir) / INCIDENTS
    if not path.is_file():
        return {}
    records, _ = read_jsonl(path)
    spikes = [r for r in records if r.get("kind") == SPIKE_KIND]
    return {
        int(record["rolled_back_to"]): number
        for number, record in enumerate(spikes, start=1)
        if "rolled_back_to" in record and not forensics_report(run_dir, number).is_file()
    }
