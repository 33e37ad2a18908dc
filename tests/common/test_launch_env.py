"""common.launch_env: the launchers' environment defaults, and the rendezvous port.

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
from common.launch_env import env_defaults, gloo_interface, ipv4_interfaces

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
