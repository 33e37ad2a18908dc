"""Console logs: rank 0 by default, every rank with TRAIN_LOG_RANKS=all, each line tagged;
the known harmless library noise (common/noise.py KNOWN_NOISE) dropped at its source unless
TRAIN_LOG_NOISE=1."""

from __future__ import annotations

import logging
import re
import sysconfig
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.noise import KNOWN_NOISE, NOISE_ENV, WARNING, filter_known_noise
from tests.utils.noise import noise_lines
from tests.utils.runs import REPO, check_ok, cli, torchrun, train_env
from train.console import ranks_shown

STEP_LINE = re.compile(r"^\[titan\] \[rank(\d+)\] .*step:\s+(\d+)", re.M)
SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"])

# Each known line as the installed libraries printed it on a 2-rank CPU run (2026-11-23).
SAMPLES = [
    "Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
    "Could not load this library: /x/_C_mxfp8.cpython-310-x86_64-linux-gnu.so",
    "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
    "torch.compile as an opaque value type.",
    "Error running lspci: [Errno 2] No such file or directory: 'lspci', fallback to use "
    "device_name",
    "Peak flops undefined for: cpu, fallback to A100",
    "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config",
    "initial_load_model_only=True has no effect without an initial_load_path.",
    "model.safetensors.index.json not found at hf_assets_path: /d/tokenizer/model.safetensors"
    ".index.json.                     Defaulting to saving a single safetensors file",
    "DTensor random operators may not have complete support on cpu device mesh",
    "DTensor manual_seed() may not have complete support on cpu device mesh",
    "Ignoring pin_memory flag for checkpoint staging as pinning memoryrequires CUDA, but CUDA "
    "is not available. ",
    "To get the last learning rate computed by the scheduler, please use `get_last_lr()`.",
]


def test_ranks_shown_parses_the_env_value():
    assert ranks_shown(None, 4) == {0}
    assert ranks_shown("all", 3) == {0, 1, 2}
    assert ranks_shown("0, 2", 4) == {0, 2}
    with pytest.raises(ValueError, match="TRAIN_LOG_RANKS='first'.*comma-separated"):
        ranks_shown("first", 4)


@pytest.mark.parametrize("noise", KNOWN_NOISE, ids=lambda n: n.source_text.strip()[:40])
def test_each_known_noise_text_is_still_what_the_installed_library_prints(noise):
    """An upgrade that rewords a line fails here, naming the line, instead of the filter
    silently letting it through again (or, worse, matching something else)."""
    source = SITE_PACKAGES / noise.source
    assert source.is_file(), f"{noise.source} is gone: re-check KNOWN_NOISE in common/noise.py"
    assert noise.source_text in source.read_text(), (
        f"{noise.source} no longer prints {noise.source_text!r}: run a training job with "
        f"{NOISE_ENV}=1, read what it prints now, and update KNOWN_NOISE in common/noise.py"
    )
    assert noise.why


def test_filters_drop_each_known_line_at_its_source_and_the_switch_keeps_them(monkeypatch):
    assert len(SAMPLES) == len(KNOWN_NOISE)

    def emitted() -> list[str]:
        seen: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())

        handler = Keep()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            filter_known_noise()
            for noise, sample in zip(KNOWN_NOISE, SAMPLES, strict=True):
                if noise.emitter is WARNING:
                    warnings.warn(sample, UserWarning, stacklevel=1)
                else:
                    logger = logging.getLogger(noise.emitter)
                    logger.addHandler(handler)
                    old_level, logger.level = logger.level, logging.WARNING
                    try:
                        logger.warning(sample)
                    finally:
                        logger.removeHandler(handler)
                        logger.setLevel(old_level)
        return seen + [str(w.message) for w in caught]

    try:
        assert emitted() == []
        monkeypatch.setenv(NOISE_ENV, "1")
        for logger in {n.emitter for n in KNOWN_NOISE if n.emitter is not WARNING}:
            for f in list(logging.getLogger(logger).filters):
                logging.getLogger(logger).removeFilter(f)
        assert sorted(emitted()) == sorted(SAMPLES)
    finally:
        for logger in {n.emitter for n in KNOWN_NOISE if n.emitter is not WARNING}:
            for f in list(logging.getLogger(logger).filters):
                logging.getLogger(logger).removeFilter(f)


def test_a_dry_run_console_has_no_import_noise_unless_asked():
    """The dry run imports what a run imports (torch, torchao, torchtitan), so it shows the
    import-time lines (torchao's kernels, torch's _pytree Enum warnings). The two dry runs
    are one process each and independent: they run side by side, a core each."""
    args = ("--config", str(REPO / "configs" / "debug.toml"), "--dry-run", "--world-size", "2")
    with ThreadPoolExecutor(2) as pool:
        quiet_run = pool.submit(cli, *args)
        noisy_run = pool.submit(cli, *args, env=dict(train_env(), **{NOISE_ENV: "1"}))
        quiet, noisy = quiet_run.result(), noisy_run.result()
    check_ok(quiet)
    assert "plan applied:" in quiet.stdout
    assert noise_lines(quiet.stdout + quiet.stderr) == []
    check_ok(noisy)
    assert any("is an Enum subclass" in line for line in noise_lines(noisy.stderr))


@pytest.mark.slow
def test_step_lines_come_from_the_ranks_asked_for(run_toml, monkeypatch):
    """One 2-rank run with TRAIN_LOG_RANKS=1 shows both directions of the filter: rank 1's
    INFO lines appear, rank 0's (the default's, `ranks_shown(None, ...)` above) do not."""
    monkeypatch.setenv("TRAIN_LOG_RANKS", "1")
    config = run_toml(
        training={"steps": 2}, validation={"enable": False}, checkpoint={"enable": False}
    )
    proc = torchrun(config, 2, timeout=300)
    check_ok(proc)
    assert sorted(STEP_LINE.findall(proc.stdout + proc.stderr)) == [("1", "1"), ("1", "2")]
    # a real multi-rank run (DTensor on a CPU mesh, MFU without lspci) prints none of the
    # known noise, on any rank
    assert noise_lines(proc.stdout + proc.stderr) == []
