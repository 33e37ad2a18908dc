"""common.launch_env: the launchers' environment defaults (the ROCm branch included), the
visible GPUs of both vendors, and the rendezvous port.

The rules as a pure function (any node shape, without its hardware); that a bare
`python -m train` and `scripts/train_local.sh` really start with them is
tests/scripts/test_launchers.py's (`test_gpus_that_torch_cannot_use_stop_training_in_one_line`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from common.io import ephemeral_port_range, free_port, port_is_free
from common.launch_env import (
    KFD,
    amd_gpu_archs,
    apply_env_defaults,
    device_kind,
    env_defaults,
    gloo_interface,
    ipv4_interfaces,
    visible_amd_gpus,
    visible_gpus,
)
from tests.utils.amd import MI300X, fake_amd_smi

REPO = Path(__file__).resolve().parents[2]

GPU_NODE = {
    "OMP_NUM_THREADS": "12",  # 96 cores / 8 processes
    "DCP_USE_PREFIX_STORE": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "NCCL_DEBUG": "WARN",
    "PYTORCH_ALLOC_CONF": "expandable_segments:True",
}


def test_defaults_per_node_kind_and_every_set_value_wins():
    assert env_defaults({}, local_procs=8, cores=96, num_gpus=8) == GPU_NODE
    cpu_node = {"OMP_NUM_THREADS": "1", "DCP_USE_PREFIX_STORE": "1"}
    assert env_defaults({}, local_procs=2, cores=2, num_gpus=0) == cpu_node
    assert env_defaults({}, local_procs=4, cores=2, num_gpus=0) == cpu_node
    user = {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4"}
    assert env_defaults(user, 8, 96, 8) == {k: v for k, v in GPU_NODE.items() if k not in user}
    # the older allocator variable is the user's choice too: PYTORCH_ALLOC_CONF would override it
    legacy = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert "PYTORCH_ALLOC_CONF" not in env_defaults(legacy, 8, 96, 8)


def test_the_checkpoint_daemons_use_the_runs_store_through_the_launchers():
    """`python -m common.launch_env exports N`, what launch_env.sh evals for train_local.sh
    and every SLURM node (and `python -m train` applies itself): DCP's async-checkpoint
    daemons join torchrun's store (DCP_USE_PREFIX_STORE=1) instead of a store on a port from
    the ephemeral range; a value the user set stays."""
    command = [sys.executable, "-m", "common.launch_env", "exports", "2"]
    base = {k: v for k, v in os.environ.items() if k != "DCP_USE_PREFIX_STORE"}
    exports = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=base)
    assert "export DCP_USE_PREFIX_STORE=1" in exports.stdout.splitlines(), exports.stdout
    user = base | {"DCP_USE_PREFIX_STORE": "0"}
    kept = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=user)
    assert "DCP_USE_PREFIX_STORE" not in kept.stdout


def test_gloo_follows_the_nccl_interface_setting():
    interfaces = ["lo", "eth0", "ib0", "ib1", "docker0"]
    nodes = {
        "ib": "ib0",  # a prefix: the first match in interface order
        "=ib1": "ib1",  # an exact name
        "ib1,eth": "eth0",
        "^lo,eth,ib": "docker0",  # exclusions
        "^docker": "eth0",  # excluding never picks the loopback
        "bond": None,  # nothing matches: nothing is set (NCCL reports its own setting)
    }
    for nccl, gloo in nodes.items():
        assert gloo_interface(nccl, interfaces) == gloo, nccl
    environ = {"NCCL_SOCKET_IFNAME": "ib"}
    assert env_defaults(environ, 1, 4, 0, interfaces)["GLOO_SOCKET_IFNAME"] == "ib0"
    assert "GLOO_SOCKET_IFNAME" not in env_defaults(
        environ | {"GLOO_SOCKET_IFNAME": "eth0"}, 1, 4, 0, interfaces
    )
    assert "GLOO_SOCKET_IFNAME" not in env_defaults({}, 1, 4, 0, interfaces)
    assert "lo" in ipv4_interfaces()  # this host's, read with the ioctl gloo's lookup matches


def test_ports_are_picked_outside_the_ephemeral_range_and_free():
    low, high = ephemeral_port_range()
    picked = [free_port() for _ in range(20)] + [free_port(host="")]
    assert all(not low <= p <= high and 10000 <= p < 65536 for p in picked), picked
    assert len(set(picked)) == len(picked)  # never the same port twice in one process
    with socket.socket() as server:
        server.bind(("0.0.0.0", picked[0]))
        server.listen()
        assert not port_is_free(picked[0], host="")
        assert not port_is_free(picked[0])  # a wildcard listener holds the loopback too
    # the batch script's check of a fixed port: one line and exit 2 when it is taken
    command = [sys.executable, "-m", "common.launch_env", "rdzv-port"]
    with socket.socket() as server:
        server.bind(("0.0.0.0", picked[1]))
        server.listen()
        taken = subprocess.run(command + [str(picked[1])], capture_output=True, text=True, cwd=REPO)
    assert taken.returncode == 2 and taken.stderr.startswith(f"error: rendezvous port {picked[1]}")
    assert len(taken.stderr.splitlines()) == 1
    chosen = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO)
    assert not low <= int(chosen.stdout) <= high


# --------------------------------------------------------------------------- AMD GPUs


def test_amd_gpus_are_read_from_amd_smi_where_dev_kfd_exists(tmp_path):
    """A stand-in `amd-smi` (tests/utils/amd.py) lists four MI300X; they count only where
    the ROCm compute device exists (a stand-in file here), and the node's architectures
    are read either way (the FP8 launch checks: train.fp8.check_fp8_device)."""
    kfd = tmp_path / "kfd"
    env = {"PATH": fake_amd_smi(tmp_path / "bin", *[MI300X] * 4)}
    assert amd_gpu_archs(env) == ["gfx942"] * 4
    assert visible_amd_gpus(env, kfd=str(kfd)) == []  # amd-smi lists them, ROCm cannot run
    assert device_kind(env, kfd=str(kfd)) == "cpu"
    kfd.touch()
    assert visible_amd_gpus(env, kfd=str(kfd)) == [
        f"GPU {i}: AMD Instinct MI300X (gfx942)" for i in range(4)
    ]
    assert visible_gpus(env, kfd=str(kfd)) == visible_amd_gpus(env, kfd=str(kfd))
    assert device_kind(env, kfd=str(kfd)) == "rocm"
    assert amd_gpu_archs({"PATH": str(tmp_path / "none")}) == []  # no amd-smi: no AMD GPU


def test_amd_visibility_follows_torchs_rocm_rule(tmp_path):
    """ROCR_VISIBLE_DEVICES narrows first, then HIP_VISIBLE_DEVICES (or, unset, CUDA's)
    picks among what is left: torch.cuda._parse_visible_devices on a ROCm build."""
    kfd = tmp_path / "kfd"
    kfd.touch()
    path = fake_amd_smi(tmp_path / "bin", *[MI300X] * 8)
    cases = [
        ({}, 8),
        ({"ROCR_VISIBLE_DEVICES": "0,1,2,3"}, 4),
        ({"ROCR_VISIBLE_DEVICES": "0,1,2,3", "HIP_VISIBLE_DEVICES": "1"}, 1),
        ({"ROCR_VISIBLE_DEVICES": "GPU-4b2c1a9f,2"}, 2),  # UUIDs count as entries
        ({"HIP_VISIBLE_DEVICES": "0,2"}, 2),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3),  # HIP honours CUDA's name too
        ({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": ""}, 1),  # HIP's wins
        ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        ({"HIP_VISIBLE_DEVICES": "-1"}, 0),
        ({"ROCR_VISIBLE_DEVICES": ""}, 0),
    ]
    for settings, count in cases:
        assert len(visible_amd_gpus({"PATH": path} | settings, kfd=str(kfd))) == count, settings


def test_rocm_branch_of_the_launch_defaults(tmp_path):
    """With AMD GPUs: RCCL takes NCCL's two rules, the allocator rule respects ROCm's own
    older name, and the ROCm runtime keeps its scratch memory; applied through the same
    one home a launcher and a bare `python -m train` use."""
    rocm_node = GPU_NODE | {"HSA_NO_SCRATCH_RECLAIM": "1"}
    assert env_defaults({}, local_procs=8, cores=96, num_gpus=8, amd=True) == rocm_node
    hip_alloc = {"PYTORCH_HIP_ALLOC_CONF": "garbage_collection_threshold:0.8"}
    assert "PYTORCH_ALLOC_CONF" not in env_defaults(hip_alloc, 8, 96, 8, amd=True)
    assert "HSA_NO_SCRATCH_RECLAIM" not in env_defaults({}, 8, 96, 8)  # NVIDIA: not ours
    kfd = tmp_path / "kfd"
    kfd.touch()
    environ = {"PATH": fake_amd_smi(tmp_path / "bin", MI300X, MI300X)}
    added = apply_env_defaults(2, environ, kfd=str(kfd))
    assert added["HSA_NO_SCRATCH_RECLAIM"] == "1" and environ["NCCL_DEBUG"] == "WARN"
    assert added["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    # the launchers' command line: amd-smi lists GPUs, but this machine has no /dev/kfd
    env = {"PATH": environ["PATH"], "PYTHONPATH": str(REPO)}
    gpus = subprocess.run(
        [sys.executable, "-m", "common.launch_env", "gpus"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=True,
    )
    assert gpus.stdout.strip() == ("2" if Path(KFD).exists() else "0")
