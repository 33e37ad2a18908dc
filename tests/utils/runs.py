"""The one home of the tests' run configs and launchers, and of the readers of what a run
leaves behind (metrics.jsonl, checkpoints).

Configs: `run_config(DATA, FOLDER, *layers, **sections)` is configs/debug.toml (or another
shipped config, `extends=`) pointed at a prepared DATA dir and writing to FOLDER, shrunk to
seconds per step on 2 shared CPU cores (`SMALL`), with each layer and then `sections`
merged over it; `write_config` puts it in a TOML file. Launchers: `torchrun` (real ranks,
`python -m torch.distributed.run`), `cli` (one plain `python -m train`), both with
`train_env()`. Session fixtures that train (tests/eval/conftest.py `trained`) and the SLURM
launcher tests write their configs through these too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tomli_w

from common import run_layout
from common.io import free_port

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

# configs/debug.toml shrunk in time only (seq 128, batch 2, 8 steps), validating and
# checkpointing every 4 steps, a metrics line every step.
SMALL = {
    "validation": {"freq": 4, "steps": 2},
    "training": {"steps": 8, "seq_len": 128, "local_batch_size": 2},
    "lr_scheduler": {"warmup_steps": 2},
    "checkpoint": {"interval": 4},
    "metrics": {"log_freq": 1},
}

# What the launcher tests (tests/scripts) run: shorter still, no validation, a checkpoint
# every 3 steps, so signals and requeues land between saves within seconds.
LAUNCHER_SIZED = {
    "validation": {"enable": False},
    "training": {"steps": 6, "seq_len": 64},
    "checkpoint": {"interval": 3},
}


def merge_sections(base: dict, top: dict) -> dict:
    """`top` merged over `base`, nested tables key by key (a list or value replaces)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = (
            merge_sections(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


def run_config(
    data: Path | None,
    folder: Path,
    *layers: dict,
    extends: str = "debug",
    small: bool = True,
    **sections: dict,
) -> dict:
    """configs/EXTENDS.toml writing to FOLDER, on DATA's tokenizer/, train/ and val/ (None:
    a layer names them), shrunk by `SMALL` (unless small=False), then each layer and
    `sections` (e.g. `training={"steps": 3}`) merged over it in order."""
    config: dict = {
        "extends": str(REPO / "configs" / f"{extends}.toml"),
        "job": {"folder": str(folder)},
    }
    if data is not None:
        data = Path(data)
        config["dataloader"] = {
            "tokenizer": str(data / "tokenizer"),
            "mix": [{"path": str(data / "train"), "weight": 1.0}],
        }
        config["validation"] = {"mix": [{"path": str(data / "val"), "weight": 1.0}]}
    for layer in ([SMALL] if small else []) + [*layers, sections]:
        config = merge_sections(config, layer)
    return config


def write_config(path: Path, config: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(config))
    return path


def train_env() -> dict:
    """The environment a test launches `python -m train` with: this checkout importable,
    unbuffered output, one OpenMP thread per process (2 shared cores)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def torchrun_cmd(config: Path, nproc: int, *args: str) -> list[str]:
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "-m",
        "train",
        "--config",
        str(config),
        *args,
    ]


def torchrun(
    config: Path, nproc: int, *args: str, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m train` under torchrun; stdout+stderr captured."""
    return subprocess.run(
        torchrun_cmd(config, nproc, *args),
        cwd=REPO,
        env=env or train_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m train ARGS` as one plain process (no torchrun)."""
    return subprocess.run(
        [PYTHON, "-m", "train", *args],
        cwd=REPO,
        env=env or train_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(run_dir: Path, kind: str = "all") -> list[dict]:
    """RUN/metrics.jsonl as dicts: every line, or only training ("train": has a loss) or
    validation ("val": has a val_loss) lines."""
    if not (run_dir / run_layout.METRICS).exists():
        return []
    records, num_torn = run_layout.read_metrics(run_dir)
    assert num_torn == 0, f"{run_dir}: {num_torn} torn line(s) in metrics.jsonl"
    key = {"all": None, "train": "loss", "val": "val_loss"}[kind]
    return [r for r in records if key is None or key in r]


def replica_ledger(run_dir: Path, group: int) -> list[dict]:
    """Replica group `group`'s ledger records (RUN/replicas/G/ledger.jsonl), as its writer
    thread has appended them so far; [] before it exists."""
    path = run_layout.replica_dir(run_dir, group) / run_layout.LEDGER
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ledger_verify(run_dir: Path) -> subprocess.CompletedProcess:
    """`python -m train.ledger verify RUN`, as a user runs it (a replica run's groups merged)."""
    return subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), "-m", "train.ledger", "verify", str(run_dir)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


def complete_steps(run_dir: Path) -> list[int]:
    from train.components.checkpoint import list_checkpoints

    return list_checkpoints(run_dir / "checkpoint")[0]


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session,
    ...), or None once the process is gone. The name may hold spaces or parentheses:
    split after its last ')'."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def live_pids() -> list[int]:
    """Every PID in /proc now."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def children_of(pid: int) -> list[int]:
    """The PIDs whose parent is `pid` (torchrun's workers), read from /proc."""
    children = []
    for child in live_pids():
        fields = proc_stat(child)  # None: ended while we listed
        if fields and int(fields[1]) == pid:
            children.append(child)
    return children
