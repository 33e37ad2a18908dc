"""scripts/bench_train.py end to end on CPU: three real torchrun training runs with the
tiny debug shapes, then the JSON and markdown it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils.tiny_model import FP8_COMPARISON_MODEL, model_flags

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_train.py"
# one micro-batch of 2 x 64 tokens a step: each variant's cost is its process start
TINY = [
    *model_flags(FP8_COMPARISON_MODEL),
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "2",
]
VARIANTS = ("bf16", "fp8_tensorwise", "fp8_rowwise")


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow
def test_bench_writes_all_three_variants_with_positive_numbers(shakespeare_data, tmp_path):
    steps, warmup = 3, 1  # two measured steps: a median over more than one
    proc = _bench(
        "--config",
        "configs/debug.toml",
        "--data",
        str(shakespeare_data),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--out",
        str(tmp_path),
        "--name",
        "train_test",
        "--",
        *TINY,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((tmp_path / "train_test.json").read_text())
    assert [r["name"] for r in report["results"]] == list(VARIANTS)
    for result in report["results"]:
        assert result["num_measured_steps"] == steps - warmup
        for key in ("tokens_per_s_per_gpu", "mfu_bf16_peak_pct", "peak_memory_gib"):
            assert result[key] > 0, (result["name"], key)
        assert result["mfu_fp8_peak_pct"] == pytest.approx(result["mfu_bf16_peak_pct"] / 2)
        assert 0 <= result["data_wait_share"] < 1
        assert "-m train" in result["command"] and "--nproc_per_node=1" in result["command"]
    fp8 = [r["command"] for r in report["results"][1:]]
    assert "tensorwise" in fp8[0] and "rowwise" in fp8[1]
    assert report["versions"]["torch"] and report["device"] and report["date"]

    markdown = (tmp_path / "train_test.md").read_text()
    for name in VARIANTS:
        assert f"| {name} |" in markdown
    assert "1.00x" in markdown  # BF16 against itself
    assert report["command"] in markdown


def test_bad_arguments_are_one_line_errors(shakespeare_data, tmp_path):
    proc = _bench(
        "--config",
        "configs/debug.toml",
        "--data",
        str(shakespeare_data),
        "--steps",
        "3",
        "--warmup",
        "3",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --warmup 3 must be below --steps 3"]
    proc = _bench("--config", "configs/debug.toml", "--data", str(tmp_path), "--out", str(tmp_path))
    assert proc.returncode == 2 and "no tokenizer/ inside" in proc.stderr
