"""Helpers the tests share: small run configs, real `python -m train` / torchrun launches,
and readers of what a run leaves behind (metrics.jsonl, checkpoints)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common import run_layout
from common.io import free_port

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def small_overrides(data: Path, folder: Path) -> dict:
    return {
        "extends": str(REPO / "configs" / "debug.toml"),
        "job": {"folder": str(folder)},
        "dataloader": {
            "tokenizer": str(data / "tokenizer"),
            "mix": [{"path": str(data / "train"), "weight": 1.0}],
        },
        "validation": {"freq": 4, "steps": 2, "mix": [{"path": str(data / "val"), "weight": 1.0}]},
        "training": {"steps": 8, "seq_len": 128, "local_batch_size": 2},
        "lr_scheduler": {"warmup_steps": 2},
        "checkpoint": {"interval": 4},
        "metrics": {"log_freq": 1},
    }


def merge_sections(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = (
            merge_sections(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


def train_env() -> dict:
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
    config: Path, nproc: int, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run `python -m train` under torchrun; stdout+stderr captured together."""
    return subprocess.run(
        torchrun_cmd(config, nproc, *args),
        cwd=REPO,
        env=train_env(),
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


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


def complete_steps(run_dir: Path) -> list[int]:
    from train.checkpoint import list_checkpoints

    return list_checkpoints(run_dir / "checkpoint")[0]


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
