"""The environment a training process starts with: one home for the launchers' defaults.

Why one home: a training process gets its environment from whoever started it. Before,
the rules lived in `scripts/slurm/launch_env.sh`, so `scripts/train_local.sh` and the SLURM
node launcher applied them and a bare `python -m train` did not: no expandable segments
(more fragmentation OOMs with FSDP), no NCCL error handling (a rank hangs in a dead
collective instead of failing). The rules are here now, in Python and standard library
only, and both kinds of caller use them: the shell launchers through this module's command
line (`eval "$(python -m common.launch_env exports N)"`, in launch_env.sh) and
`python -m train` by calling `apply_env_defaults` first thing, before torch is imported
(torch reads `OMP_NUM_THREADS` and the allocator settings when it starts).

Every rule is a default: a value already in the environment wins, so a user can always
override one for a run. The rules (`env_defaults`):

- `OMP_NUM_THREADS`: the cores this process may use, split between the local processes
  (torchrun would otherwise force 1 and warn).
- `DCP_USE_PREFIX_STORE=1`: the async checkpoint's daemons (one per rank, started by DCP at
  the first save) form their gloo group on the store the run already has (torchrun's, at
  `MASTER_ADDR:MASTER_PORT`, under a key prefix of their own) instead of a new store on a
  port DCP's coordinator picks with `get_free_port()`, from the kernel's ephemeral range:
  the race the rendezvous port left (common/io.py `free_port`): until that store binds, any
  outgoing connection on the node may be handed the same port.
- With visible GPUs only: `TORCH_NCCL_ASYNC_ERROR_HANDLING=3` (tear a process down on a
  NCCL error or timeout instead of hanging in a dead collective; 3 = abort without
  communicator cleanup, which can itself hang), `NCCL_DEBUG=WARN`, and
  `PYTORCH_ALLOC_CONF=expandable_segments:True` (torchtitan's recommendation; not set when
  the user set one of the older `PYTORCH_CUDA_ALLOC_CONF` or, on ROCm,
  `PYTORCH_HIP_ALLOC_CONF`, which `PYTORCH_ALLOC_CONF` would silently override).
- The ROCm branch, with visible AMD GPUs: the same two NCCL rules (RCCL, ROCm's NCCL,
  reads NCCL's variables, and torch's NCCL process group is RCCL in a ROCm build), the
  same allocator rule, and `HSA_NO_SCRATCH_RECLAIM=1` (the ROCm runtime keeps the scratch
  memory it gave a kernel instead of reclaiming it after each dispatch, as AMD's own
  training and RCCL launch scripts set it).
- `GLOO_SOCKET_IFNAME` from `NCCL_SOCKET_IFNAME` when that is set and it is not: on a
  multi-homed node the user names the interface for NCCL, and the gloo groups (the
  asynchronous checkpoint's, every group of a CPU run) would otherwise pick whatever the
  hostname resolves to, possibly an interface the other nodes cannot reach. NCCL's value is
  a list of prefixes (`ib`), exact names (`=ib0`) or exclusions (`^docker,lo`); gloo takes
  exact names only, so it is resolved against this host's interfaces that have an IPv4
  address, in interface order, and the first match is used (NCCL's bootstrap does the
  same). Nothing matches: nothing is set, and NCCL itself reports its setting.

Also here, because the launchers, `scripts/setup.sh` and `train/compat/cpu_compat.py` must
agree on it: which GPUs this process may use, without importing torch (`visible_gpus`).
NVIDIA's: the driver's list (`nvidia-smi -L`, else /dev/nvidiaN) filtered by
`CUDA_VISIBLE_DEVICES`. AMD's: `amd-smi`'s list, only where the ROCm compute device
/dev/kfd exists, filtered the way torch's ROCm build filters it: `ROCR_VISIBLE_DEVICES`
first, then `HIP_VISIBLE_DEVICES` (or `CUDA_VISIBLE_DEVICES` when that is unset) picks
among what is left. Empty or -1 hides every GPU, a list keeps that many.

And `env_int`, how every launcher and `python -m train` read an integer variable (RANK,
WORLD_SIZE, SLURM_*, TRAIN_*): a value that is not one is a user error naming it.

    python -m common.launch_env exports N    `export K=V` lines for N local processes
    python -m common.launch_env gpus         how many GPUs are visible
    python -m common.launch_env device       cuda, rocm or cpu: the build this machine needs
    python -m common.launch_env rdzv-port [PORT]
                                             a free rendezvous port on this host outside
                                             the ephemeral range (or check PORT is free)
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, MutableMapping

from common.exit_codes import ExitCode
from common.io import cli_error, free_port, port_is_free

KFD = "/dev/kfd"  # the ROCm runtime's compute device: without it no AMD GPU is usable


def env_int(name: str, default: int | None) -> int | None:
    """The integer in environment variable `name`, else `default` (ValueError naming it)."""
    value = os.environ.get(name)
    try:
        return default if value is None else int(value)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={value!r} is not an integer; set it to one or unset it"
        ) from None


def visible_gpus(environ: Mapping[str, str] = os.environ, kfd: str | None = None) -> list[str]:
    """The GPUs this process may use, as the drivers see them (not torch): NVIDIA's
    (`visible_nvidia_gpus`), then AMD's (`visible_amd_gpus`)."""
    return visible_nvidia_gpus(environ) + visible_amd_gpus(environ, kfd)


def _keep(gpus: list[str], setting: str | None) -> list[str]:
    """A *_VISIBLE_DEVICES value applied to a list: unset keeps all, empty or -1 hides
    all, a list of indices or UUIDs keeps that many."""
    if setting is None:
        return gpus
    if setting.strip() in ("", "-1"):
        return []
    return gpus[: len([d for d in setting.split(",") if d.strip()])]


def _run(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def visible_nvidia_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The NVIDIA GPUs this process may use: the `nvidia-smi -L` lines, else one entry per
    /dev/nvidiaN, filtered by CUDA_VISIBLE_DEVICES."""
    hidden = environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return []  # no nvidia-smi call for a process told to see none
    nvidia_smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    listed = _run([nvidia_smi, "-L"]) if nvidia_smi else ""
    gpus = [line.strip() for line in listed.splitlines() if line.startswith("GPU ")]
    return _keep(gpus or sorted(glob.glob("/dev/nvidia[0-9]*")), hidden)


def amd_gpus(environ: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """(market name, architecture) of every AMD GPU of this node, in `amd-smi`'s order
    (`amd-smi static --asic`: a `GPU: N` block per GPU with MARKET_NAME and
    TARGET_GRAPHICS_VERSION, e.g. gfx942; amd-smi before ROCm 6.2 has no architecture
    line: ""). [] without amd-smi. No visibility filter: what the node has."""
    amd_smi = shutil.which("amd-smi", path=environ.get("PATH"))
    if not amd_smi:
        return []
    found: list[list[str]] = []
    for line in _run([amd_smi, "static", "--asic"]).splitlines():
        key, _, value = line.strip().partition(":")
        key = key.strip().upper().replace(" ", "_")
        if key == "GPU":
            found.append(["AMD GPU", ""])
        elif found and key == "MARKET_NAME":
            found[-1][0] = value.strip()
        elif found and key == "TARGET_GRAPHICS_VERSION":
            found[-1][1] = value.strip()
    return [(name, arch) for name, arch in found]


def amd_gpu_archs(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The architecture of each AMD GPU of this node (`amd_gpus`), unknown ones left out."""
    return [arch for _, arch in amd_gpus(environ) if arch]


def visible_amd_gpus(environ: Mapping[str, str] = os.environ, kfd: str | None = None) -> list[str]:
    """The AMD GPUs this process may use: `amd-smi`'s, when the ROCm compute device
    (/dev/kfd) exists (a container started without it sees the GPUs in amd-smi and can
    use none), filtered as torch's ROCm build filters them (`torch.cuda.
    _parse_visible_devices`): ROCR_VISIBLE_DEVICES first (the runtime's own list), then
    HIP_VISIBLE_DEVICES, or CUDA_VISIBLE_DEVICES when HIP's is unset, picks among those."""
    if not os.path.exists(kfd or KFD):  # `kfd`: a stand-in for tests
        return []
    gpus = [
        f"GPU {i}: {name}" + (f" ({arch})" if arch else "")
        for i, (name, arch) in enumerate(amd_gpus(environ))
    ]
    gpus = _keep(gpus, environ.get("ROCR_VISIBLE_DEVICES"))
    hip = environ.get("HIP_VISIBLE_DEVICES")
    return _keep(gpus, hip if hip is not None else environ.get("CUDA_VISIBLE_DEVICES"))


def device_kind(environ: Mapping[str, str] = os.environ, kfd: str | None = None) -> str:
    """Which build a venv on this machine needs: "cuda" with a visible NVIDIA GPU, "rocm"
    with a visible AMD one, else "cpu" (`scripts/setup.sh --device auto`)."""
    if visible_nvidia_gpus(environ):
        return "cuda"
    return "rocm" if visible_amd_gpus(environ, kfd) else "cpu"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: what `nproc` prints)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ipv4_interfaces() -> list[str]:
    """This host's network interfaces that have an IPv4 address, in interface order (the
    ones gloo can bind to by name)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915  # Linux ioctl: the interface's IPv4 address
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address (down, or IPv6 only)
                continue
            found.append(name)
    return found


def gloo_interface(nccl_ifname: str, interfaces: list[str]) -> str | None:
    """The interface gloo should use for an `NCCL_SOCKET_IFNAME` value, among `interfaces`
    (in order): the first one NCCL's rules select, or None."""
    spec = nccl_ifname.strip()
    exclude = spec.startswith("^")
    patterns = [p.strip() for p in spec.removeprefix("^").split(",") if p.strip()]

    def matches(name: str) -> bool:
        return any(name == p[1:] if p.startswith("=") else name.startswith(p) for p in patterns)

    def selected(name: str) -> bool:  # an exclusion list never selects the loopback
        return name != "lo" and not matches(name) if exclude else matches(name)

    return next((name for name in interfaces if selected(name)), None)


_GPU_ONLY = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG")
# the allocator's older names, each overridden by PYTORCH_ALLOC_CONF when both are set
# (torch reads PYTORCH_ALLOC_CONF first, then PYTORCH_CUDA_ALLOC_CONF, then on ROCm
# PYTORCH_HIP_ALLOC_CONF): one set by the user means the user chose
_ALLOC_CONFS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def env_defaults(
    environ: Mapping[str, str],
    local_procs: int,
    cores: int,
    num_gpus: int,
    interfaces: list[str] | None = None,
    amd: bool = False,
) -> dict[str, str]:
    """The variables to add to `environ` for `local_procs` processes on this node (`cores`
    usable cores, `num_gpus` visible GPUs, AMD ones when `amd`, `interfaces` with an IPv4
    address, listed on demand when None): only those not already set."""
    rules = {"OMP_NUM_THREADS": str(max(1, cores // max(1, local_procs)))}
    rules["DCP_USE_PREFIX_STORE"] = "1"
    if num_gpus > 0:
        # RCCL, ROCm's NCCL, reads NCCL's variables, and torch's NCCL process group is
        # RCCL on a ROCm build: the same two rules for both vendors
        rules["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
        rules["NCCL_DEBUG"] = "WARN"
        if not any(name in environ for name in _ALLOC_CONFS[1:]):
            rules["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
        if amd:
            rules["HSA_NO_SCRATCH_RECLAIM"] = "1"
    nccl_ifname = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if nccl_ifname and "GLOO_SOCKET_IFNAME" not in environ:
        gloo = gloo_interface(nccl_ifname, ipv4_interfaces() if interfaces is None else interfaces)
        if gloo is not None:
            rules["GLOO_SOCKET_IFNAME"] = gloo
    return {key: value for key, value in rules.items() if key not in environ}


def apply_env_defaults(
    local_procs: int, environ: MutableMapping[str, str] = os.environ, kfd: str | None = None
) -> dict[str, str]:
    """Set the defaults for `local_procs` processes on this node in `environ` (this
    process's environment by default); returns what was added."""
    gpu_rules_settled = all(key in environ for key in _GPU_ONLY) and any(
        name in environ for name in _ALLOC_CONFS
    )
    # a worker under a launcher has them all: no `nvidia-smi`/`amd-smi` call per worker
    nvidia = [] if gpu_rules_settled else visible_nvidia_gpus(environ)
    amd = [] if gpu_rules_settled else visible_amd_gpus(environ, kfd)
    added = env_defaults(
        environ, local_procs, usable_cores(), len(nvidia) + len(amd), amd=bool(amd)
    )
    environ.update(added)
    return added


def main(argv: list[str]) -> int:
    usage = "usage: python -m common.launch_env {exports N | gpus | device | rdzv-port [PORT]}"
    if argv in (["gpus"], ["device"]):
        print(len(visible_gpus()) if argv == ["gpus"] else device_kind())
        return 0
    if argv[:1] == ["exports"] and len(argv) == 2 and argv[1].isdigit() and int(argv[1]) > 0:
        for key, value in apply_env_defaults(int(argv[1]), dict(os.environ)).items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    if argv[:1] == ["rdzv-port"] and len(argv) <= 2:
        if len(argv) == 1 or not argv[1]:
            print(free_port(host=""))
            return 0
        port = argv[1]
        if not port.isdigit() or not 0 < int(port) < 65536:
            return cli_error(f"rendezvous port {port!r} is not a port number")
        if not port_is_free(int(port), host=""):
            return cli_error(
                f"rendezvous port {port} (TRAIN_RDZV_PORT / --port) is in use on "
                f"{socket.gethostname()}: pick another, or leave it unset to pick a free one"
            )
        print(port)
        return 0
    print(usage, file=sys.stderr)
    return ExitCode.USER_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
