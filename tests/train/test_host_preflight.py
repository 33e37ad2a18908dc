"""The host preflight (`train.preflight.check_host`, issue 27 item 1): what an async
checkpoint needs of the machine, checked by `python -m train --check`, the launchers and
every worker at start-up, before the first save finds out.

- A save of more state-dict tensors than the usual soft `nofile` limit of 1,024, through
  the real async path (the pinned stager and DCP's checkpoint daemon), in a process started
  under that limit: without start-up it fails with "Too many open files"; after start-up
  (which raises the soft limit to the hard one) it is on disk.
- Bad input, one line naming the fix, exit 2, through `--check` and
  scripts/train_local.sh: a hard limit too small for the staged tensors; a node whose
  /dev/shm or RAM cannot hold its ranks' staging. What each `async_mode` needs: only the
  pinned mode keeps open files and /dev/shm, "async" needs RAM during a save, "disabled"
  nothing.
- The counts at the shipped sizes: 1,164 tensors at 8B, 2,892 at 70B, about 197 GiB per
  node at 70B on 32 GPUs (the figures of the review that found the first save failing).
  That the formula is the real state dict's is tests/train/components/test_async_checkpoint.py's.
"""

from __future__ import annotations

import math
import resource
import subprocess
import sys

import pytest

from tests.train.test_bad_inputs import assert_one_line_error
from tests.utils.runs import LAUNCHER_SIZED, REPO, run_config, train_env, write_config
from train.config import load_config
from train.preflight import GIB, OTHER_OPEN_FILES, available_memory, shm_free, staged_state_dict

TRAIN_LOCAL = REPO / "scripts" / "train_local.sh"

# 29 small layers: 4 x (29 x 9 + 3) = 1,056 state-dict tensors, more than a soft limit of
# 1,024 open files
MANY_TENSORS = {
    "dim": 16,
    "n_layers": 29,
    "n_heads": 2,
    "n_kv_heads": 1,
    "ffn_hidden_dim": 32,
    "max_seq_len": 256,
}
USUAL_SOFT_LIMIT = 1024


def test_the_state_dict_at_8b_and_70b():
    degrees_8b = {"dp_replicate": 1, "dp_shard": 8, "tp": 1, "cp": 1}
    assert (
        staged_state_dict(load_config(REPO / "configs/llama3_8b_fp8.toml"), degrees_8b).tensors
        == 1164
    )
    run_70b = load_config(REPO / "configs/llama3_70b_fp8.toml")
    staged = staged_state_dict(run_70b, {"dp_replicate": 1, "dp_shard": 4, "tp": 8, "cp": 1})
    assert staged.tensors == 2892
    # fp32 weight + two fp32 moments, 12 bytes per parameter, over 32 ranks; 8 per node
    assert staged.bytes * 8 / GIB == pytest.approx(197.1, abs=0.1)


SAVE_UNDER_THE_SOFT_LIMIT = """
import gc, os, resource, sys
config, folder, port = sys.argv[1:]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
assert soft == {soft}, (soft, hard)
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
from train.config import load_config
from train.runtime import prepare_runtime
run = load_config(config)
prepare_runtime()
import torch.distributed as dist
from tests.utils.checkpointer import model_and_checkpointer, staged_states
from train.components.dcp_workarounds import pinned_memory_stager
dist.init_process_group("gloo")

# without start-up: the staging copy alone runs out of open files
_, checkpointer = model_and_checkpointer(run, 1, folder, async_mode="async_with_pinned_mem")
stager = pinned_memory_stager()
try:
    stager.stage(staged_states(checkpointer)).result()
    print("STAGED UNDER THE SOFT LIMIT")
except Exception as e:
    print("WITHOUT START-UP:", e)
stager.close()
del stager  # and with it the failed staging's partial copy (its open files)
gc.collect()

# start-up (what `python -m train` runs in every worker), then the real async save:
# staged in shared memory, handed to DCP's checkpoint daemon, written, waited for
from train.preflight import preflight
preflight(run, 1)
print("SOFT LIMIT", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
checkpointer.save_now(1)
checkpointer.close()
print("SAVED", os.path.exists(os.path.join(folder, "checkpoint", "step-1", ".metadata")))
dist.destroy_process_group()
"""


def test_an_async_save_of_more_tensors_than_the_soft_limit_after_start_up(run_toml, tmp_path):
    from common.io import free_port

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    config = run_toml(model=MANY_TENSORS, fp8={"enable": False}, validation={"enable": False})
    staged = staged_state_dict(
        load_config(config), {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "cp": 1}
    )
    assert staged.tensors > USUAL_SOFT_LIMIT
    if hard < 2 * staged.tensors + OTHER_OPEN_FILES + 1:
        pytest.skip(f"this host's hard nofile limit ({hard}) is too small to show it")
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_UNDER_THE_SOFT_LIMIT.format(soft=USUAL_SOFT_LIMIT),
         str(config), str(tmp_path / "run"), str(free_port())],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=180,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (USUAL_SOFT_LIMIT, hard)),
    )  # fmt: skip
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    without = [line for line in proc.stdout.splitlines() if line.startswith("WITHOUT START-UP")]
    assert without and "Too many open files" in without[0], out
    assert f"SOFT LIMIT {hard}" in proc.stdout, out
    assert "SAVED True" in proc.stdout, out


def _under_open_file_limit(limit: int, *command: str) -> subprocess.CompletedProcess:
    """COMMAND in a shell whose soft and hard `nofile` limits are LIMIT (`ulimit -n`)."""
    return subprocess.run(
        ["bash", "-c", f'ulimit -n {limit} && exec "$@"', "bash", *command],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_hard_open_file_limit_too_small_is_refused_in_one_line(shakespeare_data, tmp_path):
    config = write_config(
        tmp_path / "run.toml", run_config(shakespeare_data, tmp_path / "run", LAUNCHER_SIZED)
    )
    limit = 512  # the debug model's 156 tensors need 2 x 156 + 1,024 + 2
    check = [sys.executable, "-m", "train", "--check", "--world-size", "2", "--config", str(config)]
    fragments = (
        "checkpoint.async_mode = 'async_with_pinned_mem'",
        "ulimit -Hn",
        "is 512",
        "'async'",
    )
    assert_one_line_error(_under_open_file_limit(limit, *check), *fragments)
    assert_one_line_error(_under_open_file_limit(limit, str(TRAIN_LOCAL), str(config)), *fragments)
    # the modes that keep no shared memory pass the same host
    for mode in ("async", "disabled"):
        proc = _under_open_file_limit(limit, *check, "--checkpoint.async_mode", mode)
        assert proc.returncode == 0, proc.stderr


def test_a_node_that_cannot_hold_its_staging_is_refused_in_one_line(shakespeare_data, tmp_path):
    """70B on 32 GPUs, 8 per node: each node stages about 197 GiB. Deep enough (more layers
    of the same width) to exceed this host's /dev/shm and RAM whatever they are."""
    run = load_config(REPO / "configs/llama3_70b_fp8.toml")
    degrees = {"dp_replicate": 1, "dp_shard": 4, "tp": 8, "cp": 1}
    per_node = 8 * staged_state_dict(run, degrees).bytes
    host = max(shm_free() or 0, available_memory() or 0)
    layers = run.model.n_layers * max(1, math.ceil(2 * host / per_node))
    config = write_config(
        tmp_path / "run.toml",
        run_config(shakespeare_data, tmp_path / "run", extends="llama3_70b_fp8", small=False),
    )
    check = [sys.executable, "-m", "train", "--check", "--world-size", "32", "--config", str(config),
             "--model.n_layers", str(layers)]  # fmt: skip
    env = train_env() | {"TRAIN_NPROC_PER_NODE": "8"}  # the SLURM launcher's, in --check

    def run_check(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*check, *args], cwd=REPO, env=env, capture_output=True, text=True)

    if shm_free() is not None:
        assert_one_line_error(run_check(), "/dev/shm", "8 rank(s)", "--shm-size", "'async'")
    assert_one_line_error(
        run_check("--checkpoint.async_mode", "async"), "host RAM during each save", "'disabled'"
    )
    proc = run_check("--checkpoint.async_mode", "disabled")  # stages nothing
    assert proc.returncode == 0, proc.stderr
