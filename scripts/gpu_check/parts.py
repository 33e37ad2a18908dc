"""The GPU check's parts, one function each; each returns a JSON-able dict of what it measured.

Every part runs in its own process (`python scripts/gpu_check part NAME`), so a crash, a
hang or a CUDA error in one cannot take the others down, and its time cap is enforced by
killing it (`__main__.run_parts`). Each part has two sizes: the real one, on the leased GPU,
and the rehearsal's (`--rehearse`), the same code at tiny shapes on CPU, so CI keeps every
line of it working between lucky draws. A rehearsal makes no timing claims.

What each part answers (issue 32):
- `env`: the machine and the versions, and where they differ from the project's pins.
- `gemm`: `torch._scaled_mm` tensorwise and rowwise against bf16 at the Llama 3 8B and 70B
  linear shapes with 8,192 tokens: TFLOP/s, the FP8/bf16 ratio, error against fp32.
- `flex`: the document-masked FlexAttention the trainer builds (torchtitan's own mask
  functions, its compiled flex kernel), its block tables against the mask they encode,
  forward and backward against our CPU attention (`train.attention.DocumentMaskedSDPA`,
  the dense mask through SDPA) in fp32 on the same packed documents; then at 32,768
  tokens (`flex_long`): block tables, time and memory.
- `layers`, `tp_shapes`, `parity` (issue 43): in `scaling`, which also runs what the
  `step` part of the first report ran (the 8B at 2 layers, FP8 and bf16, beside the plan).
- `trainer`: configs/debug.toml for 20 steps with FP8, compile, async checkpoints, the
  loader, health, ledger and watchdog on; a resume from its step-10 checkpoint in a second
  folder must reproduce steps 11-20; the ledger verifies.
- `replica` (issue 41): one replica group over torchft's NCCL group commits 3 steps and
  its ledger verifies (`part_replica`).
- `vllm`: vLLM 0.32's Triton attention kernels (their source, carried) compiled on the GPU
  against SDPA, as tests/eval/test_triton_attention.py checks them under the interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch_bridge  # next to this file: on the path of every process that imports it

REPO = Path(__file__).resolve().parents[2]
BRIDGE = Path(__file__).with_name("torch_bridge.py")
CHILD_GROUPS = "child_groups.txt"  # process groups the parts started, one pid per line


@dataclass
class Context:
    rehearse: bool
    work: Path  # this part's scratch folder
    inputs: Path  # what `prepare` made: wheels, data, plan.json, vllm kernels
    deadline: float  # time.monotonic() by which the part must have returned

    @property
    def device(self) -> str:
        import torch

        return "cuda" if torch.cuda.is_available() and not self.rehearse else "cpu"

    def left(self) -> float:
        return self.deadline - time.monotonic()


# ----------------------------------------------------------------------------------- a. env


def _pins() -> dict[str, str]:
    """name -> pinned version: pyproject's `==` dependencies and setup.sh's vLLM."""
    import re
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    split = (dep.partition("==") for dep in project["dependencies"])
    pins = {name.strip().lower(): version.strip() for name, sep, version in split if sep}
    setup = (REPO / "scripts" / "setup.sh").read_text()
    if vllm := re.search(r"^VLLM_VERSION=(\S+)", setup, re.M):
        pins["vllm"] = vllm.group(1)
    return pins


def _installed(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def nvidia_smi(query: str) -> str:
    """`nvidia-smi --query-gpu=QUERY` as CSV; OSError or SubprocessError without one."""
    smi = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"]
    return subprocess.run(
        smi, capture_output=True, text=True, timeout=20, check=True
    ).stdout.strip()


def part_env(ctx: Context) -> dict:
    import platform

    import torch

    out: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "triton": _installed("triton"),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 2),
            "capability": list(torch.cuda.get_device_capability(0)),
            "multiprocessors": props.multi_processor_count,
        }
        try:
            out["nvidia_smi"] = nvidia_smi("driver_version,name,memory.total,clocks.max.sm")
            out["driver"] = out["nvidia_smi"].split(",")[0].strip()
        except (OSError, subprocess.SubprocessError) as err:
            out["nvidia_smi"] = f"unavailable: {err}"
    # a local suffix (torch's +cu130, +cpu) is a build, not a version
    out["pins"] = [
        {"package": name, "pinned": want, "here": _installed(name),
         "match": (_installed(name) or "").split("+")[0] == want}
        for name, want in sorted(_pins().items())
    ]  # fmt: skip
    out["bridged_gaps"] = torch_bridge.apply()
    return out


# ---------------------------------------------------------------------------------- b. gemm

# (model, linear, K (in), N (out)); M = tokens per GEMM
LINEARS = [
    ("8B", "wq, wo", 4096, 4096),
    ("8B", "wk, wv", 4096, 1024),
    ("8B", "w1, w3", 4096, 14336),
    ("8B", "w2", 14336, 4096),
    ("70B", "wq, wo", 8192, 8192),
    ("70B", "wk, wv", 8192, 1024),
    ("70B", "w1, w3", 8192, 28672),
    ("70B", "w2", 28672, 8192),
]
TOKENS = 8192
E4M3_MAX = 448.0


def _time_ms(fn, device: str, warmup: int, repeat: int) -> float:
    """Median milliseconds of `fn()`: device events on CUDA, a host clock on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _to_e4m3(x, amax):
    """x scaled so its amax maps to e4m3's largest value, cast; returns (fp8, inverse scale)."""
    import torch

    scale = E4M3_MAX / amax.clamp(min=1e-12).float()
    x8 = (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, scale.reciprocal()


def _rel_err(got, want) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def part_gemm(ctx: Context) -> dict:
    import torch

    device = ctx.device
    shrink = 32 if ctx.rehearse else 1
    warmup, repeat = (1, 2) if ctx.rehearse else (3, 20)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is fp32
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for model, name, k, n in LINEARS:
        if ctx.left() < 5:
            rows.append({"model": model, "linear": name, "skipped": "out of time"})
            continue
        m, k, n = TOKENS // shrink, k // shrink, n // shrink
        a = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(torch.bfloat16)
        ref = a.float() @ w.float().t()
        a8_t, sa_t = _to_e4m3(a, a.abs().max())
        w8_t, sw_t = _to_e4m3(w, w.abs().max())
        a8_r, sa_r = _to_e4m3(a, a.abs().amax(dim=1, keepdim=True))  # [m, 1]
        w8_r, sw_r = _to_e4m3(w, w.abs().amax(dim=1, keepdim=True))  # [n, 1]
        variants = {
            "bf16": lambda a=a, w=w: a @ w.t(),
            "fp8_tensorwise": lambda a8=a8_t, w8=w8_t, sa=sa_t, sw=sw_t: torch._scaled_mm(
                a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16
            ),
            "fp8_rowwise": lambda a8=a8_r, w8=w8_r, sa=sa_r, sw=sw_r: torch._scaled_mm(
                a8, w8.t(), scale_a=sa, scale_b=sw.t().contiguous(), out_dtype=torch.bfloat16
            ),
        }
        row: dict = {"model": model, "linear": name, "m": m, "k": k, "n": n}
        flops = 2.0 * m * k * n
        for variant, fn in variants.items():
            try:
                row[f"{variant}_rel_err"] = _rel_err(fn(), ref)
                ms = _time_ms(fn, device, warmup, repeat)
                row[f"{variant}_ms"] = ms
                row[f"{variant}_tflops"] = flops / (ms * 1e-3) / 1e12
            except Exception as err:  # a recipe this build lacks is a finding, not a crash
                row[f"{variant}_error"] = f"{type(err).__name__}: {err}"[:300]
        for variant in ("fp8_tensorwise", "fp8_rowwise"):
            if f"{variant}_ms" in row and "bf16_ms" in row:
                row[f"{variant}_speedup"] = row["bf16_ms"] / row[f"{variant}_ms"]
        rows.append(row)
        del a, w, ref
    return {"tokens": TOKENS // shrink, "rows": rows, "timed_on": device}


# ---------------------------------------------------------------------------------- d. flex


def packed_positions(seq_len: int, seed: int, shortest: int, longest: int):
    """Positions of one packed sequence: documents of seeded random lengths, each
    counting from 0, as the loader packs them (the last one cut at seq_len)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    parts, total = [], 0
    while total < seq_len:
        n = int(torch.randint(shortest, longest + 1, (1,), generator=gen))
        parts.append(torch.arange(min(n, seq_len - total)))
        total += n
    return torch.cat(parts).view(1, seq_len)


def document_block_mask(positions, block_size: int, compiled: bool = True):
    """The BlockMask the trainer builds for `positions`: torchtitan's causal + packed
    document mask_mods through its compiled `create_attention_mask`, as
    `Decoder._create_flex_attention_mask_for_document` calls them (`compiled=False`: the
    same function uncompiled, for the CPU rehearsal, where compiling it costs 17 s)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask
    from torchtitan.models.common.attention import (
        create_attention_mask,
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    if not compiled:
        create_attention_mask = create_block_mask  # noqa: N806

    batch, seq_len = positions.shape
    mask_mod = and_masks(
        get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions)
    )
    return create_attention_mask(
        mask_mod, batch, None, seq_len, seq_len, device=positions.device,
        BLOCK_SIZE=block_size, separate_full_blocks=True,
    )  # fmt: skip


def block_table_errors(block_mask, positions, block_size: int) -> dict:
    """The block tables against the mask they encode: each (q block, kv block) is full
    (every pair attends), partial, or empty, computed densely from the positions."""
    import torch

    seq_len = positions.shape[1]
    doc = torch.cumsum((positions[0] == 0).int(), 0)
    idx = torch.arange(seq_len, device=positions.device)
    dense = (doc[:, None] == doc[None, :]) & (idx[:, None] >= idx[None, :])
    nb = seq_len // block_size
    per_block = dense.view(nb, block_size, nb, block_size).sum(dim=(1, 3))
    full_want = per_block == block_size * block_size
    partial_want = (per_block > 0) & ~full_want

    def table(num, index):
        got = torch.zeros(nb, nb, dtype=torch.bool, device=positions.device)
        for q in range(nb):
            got[q, index[0, 0, q, : int(num[0, 0, q])].long()] = True
        return got

    partial_got = table(block_mask.kv_num_blocks, block_mask.kv_indices)
    full_got = table(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return {
        "q_blocks": nb,
        "partial_blocks": int(partial_want.sum()),
        "full_blocks": int(full_want.sum()),
        "empty_blocks": int((per_block == 0).sum()),
        "partial_mismatches": int((partial_got != partial_want).sum()),
        "full_mismatches": int((full_got != full_want).sum()),
        "attended_fraction_of_causal": float(dense.sum()) / (seq_len * (seq_len + 1) / 2),
    }


def masked_documents(ctx: Context, seq_len: int, block: int, seed: int, shortest: int,
                     longest: int):  # fmt: skip
    """Packed positions, the trainer's BlockMask for them, and what a part reports of both:
    the documents, the mask's build time, its block tables against the mask they encode."""
    positions = packed_positions(seq_len, seed, shortest, longest).to(ctx.device)
    t0 = time.perf_counter()
    block_mask = document_block_mask(positions, block, compiled=not ctx.rehearse)
    return positions, block_mask, {
        "documents": int((positions == 0).sum()), "mask_build_s": time.perf_counter() - t0,
        "block_tables": block_table_errors(block_mask, positions, block),
    }  # fmt: skip


def flex_kernel(device: str, block_mask):
    """The trainer's kernel on [batch, heads, seq, head_dim]: torchtitan's compiled
    flex_attention (eager on the CPU rehearsal)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention
    from torchtitan.models.common.attention import FlexAttention

    kw = dict(score_mod=None, block_mask=block_mask, scale=None, enable_gqa=True)
    if device != "cuda":
        return lambda q, k, v: flex_attention(q, k, v, **kw)
    return lambda q, k, v: FlexAttention.compiled_flex_attn(
        q, k, v, **kw, return_aux=AuxRequest(lse=False), kernel_options={}
    )[0]


def part_flex(ctx: Context) -> dict:
    import torch

    torch_bridge.apply()
    from train.attention import document_sdpa_cls

    device = ctx.device
    torch.backends.cuda.matmul.allow_tf32 = False
    if ctx.rehearse:
        seq_len, heads, kv_heads, head_dim, block = 256, 4, 2, 16, 32
        dtype, shortest, longest = torch.float32, 20, 120
    else:  # Llama 3 8B attention at the shipped seq_len; documents 64 to 3,000 tokens
        seq_len, heads, kv_heads, head_dim, block = 8192, 32, 8, 128, 128
        dtype, shortest, longest = torch.bfloat16, 64, 3000
    _, block_mask, masked = masked_documents(ctx, seq_len, block, 1, shortest, longest)
    out: dict = {"seq_len": seq_len, "heads": heads, "kv_heads": kv_heads,
                 "head_dim": head_dim, "dtype": str(dtype), **masked}  # fmt: skip

    gen = torch.Generator(device=device).manual_seed(2)
    q, k, v, dout = (
        torch.randn(1, seq_len, h, head_dim, device=device, generator=gen, dtype=dtype)
        for h in (heads, kv_heads, kv_heads, heads)
    )

    kernel = flex_kernel(device, block_mask)

    def flex(q, k, v):  # the model's [batch, seq, heads, head_dim]
        return kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    sdpa = document_sdpa_cls()
    reference = sdpa(sdpa.Config())  # our CPU attention: the mask made dense, through SDPA

    def grads(fn, dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        o.backward(dout.to(dt))
        return o.detach(), [t.grad for t in leaves]

    ref_out, ref_grads = grads(
        lambda a, b, c: reference(a, b, c, attention_masks=block_mask, enable_gqa=True),
        torch.float32,
    )
    t0 = time.perf_counter()
    try:
        got_out, got_grads = grads(flex, dtype)
        out["backward"] = True
    except Exception as err:  # FlexAttention has no CPU backward in torch 2.13
        out["backward"] = f"{type(err).__name__}: {err}"[:300]
        with torch.no_grad():
            got_out, got_grads = flex(q, k, v), None
    if device == "cuda":
        torch.cuda.synchronize()
    out["first_call_s (compile + autotune)"] = time.perf_counter() - t0
    out["out_rel_err"] = _rel_err(got_out, ref_out)
    if got_grads is not None:
        for name, g, r in zip(("dq", "dk", "dv"), got_grads, ref_grads, strict=True):
            out[f"{name}_rel_err"] = _rel_err(g, r)
    # the 8B rows: bf16 flex against fp32; the rehearsal: fp32 both ways
    out["tolerance"] = 2e-2 if dtype == torch.bfloat16 else 1e-4
    errs = [v for key, v in out.items() if key.endswith("_rel_err")]
    out["ok"] = (
        max(errs) <= out["tolerance"]
        and out["block_tables"]["partial_mismatches"] == 0
        and out["block_tables"]["full_mismatches"] == 0
    )
    if device == "cuda" and out["backward"] is True:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def fwd():  # the training graph's forward (no_grad would compile another graph)
            flex(*leaves)

        def fwd_bwd():
            flex(*leaves).backward(dout)

        out["forward_ms"] = _time_ms(fwd, device, 2, 10)
        out["forward_backward_ms"] = _time_ms(fwd_bwd, device, 2, 10)
        # FLOPs the mask keeps: 4 * L^2/2 * d * heads forward over the causal triangle,
        # times the attended fraction; backward 2.5x forward (S recomputed)
        causal = 4 * seq_len * (seq_len + 1) / 2 * head_dim * heads
        kept = causal * out["block_tables"]["attended_fraction_of_causal"]
        out["forward_tflops_masked"] = kept / (out["forward_ms"] * 1e-3) / 1e12
        out["forward_backward_tflops_masked"] = (
            3.5 * kept / (out["forward_backward_ms"] * 1e-3) / 1e12
        )
    out["long"] = flex_long(ctx)
    out["ok"] = out["ok"] and out["long"]["ok"]
    return out


def flex_long(ctx: Context) -> dict:
    """The long-context stage's first phase on one GPU (issue 43): 8B attention at 32,768
    tokens, documents up to half the sequence, its block tables against the mask they
    encode, and the compiled flex forward and backward: time and peak memory. No CP: one
    rank holds the whole sequence, so this is the mask CP's ranks share, which their
    `_create_cp_block_mask` asks through the balancer's rearrangement
    (tests/train/test_context_parallel.py). The rehearsal: 1,024 tokens, forward only
    (FlexAttention has no CPU backward)."""
    import torch

    device = ctx.device
    seq_len, heads, kv_heads, head_dim, block = (
        (1024, 4, 2, 16, 32) if ctx.rehearse else (32768, 32, 8, 128, 128)
    )
    dtype = torch.float32 if ctx.rehearse else torch.bfloat16
    _, block_mask, masked = masked_documents(ctx, seq_len, block, 4, seq_len // 64, seq_len // 2)
    out: dict = {"seq_len": seq_len, "heads": heads, "kv_heads": kv_heads, **masked}
    gen = torch.Generator(device=device).manual_seed(5)
    q, k, v = (torch.randn(1, h, seq_len, head_dim, device=device, generator=gen, dtype=dtype)
               .requires_grad_(device == "cuda") for h in (heads, kv_heads, kv_heads))  # fmt: skip
    kernel = flex_kernel(device, block_mask)

    def step():
        if device != "cuda":
            with torch.no_grad():
                return kernel(q, k, v)
        o = kernel(q, k, v)
        o.backward(torch.ones_like(o))

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step()
    out["first_call_s (compile + autotune)"] = time.perf_counter() - t0
    out["forward_backward_ms" if device == "cuda" else "forward_ms"] = _time_ms(
        step, device, 1, 3 if ctx.rehearse else 10
    )
    if device == "cuda":
        out["peak_gib_over_inputs"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    tables = out["block_tables"]
    out["ok"] = tables["partial_mismatches"] == tables["full_mismatches"] == 0
    return out


# ------------------------------------------------------------------- e: trainer (and scaling's)


def write_run_config(path: Path, extends: str, data: Path, sections: dict) -> Path:
    """A run TOML extending the shipped config `extends` (configs/debug.toml, ...) on the
    carried Shakespeare data."""
    import tomli_w

    run = {"extends": str(REPO / "configs" / f"{extends}.toml"), **sections}
    run["dataloader"] = {"tokenizer": str(data / "tokenizer"), **sections.get("dataloader", {})}
    for name, split in (("dataloader", "train"), ("validation", "val")):
        run[name] = {**run.get(name, {}), "mix": [{"path": str(data / split), "weight": 1.0}]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(run))
    return path


def train_command(config: Path, *overrides: str) -> list[str]:
    """`python -m train`, through the torch bridge when this torch lacks what torchtitan
    0.3.0 calls (then on the partial_dtensor SPMD backend; torch_bridge.py says why)."""
    if torch_bridge.apply():
        return [sys.executable, str(BRIDGE), "-m", "train", "--config", str(config),
                "--parallelism.spmd_backend", "partial_dtensor", *overrides]  # fmt: skip
    return [sys.executable, "-m", "train", "--config", str(config), *overrides]


def _env_with_repo() -> dict:
    """This environment with the checkout first on PYTHONPATH, keeping what is there (on
    the device, the carried wheels' folder)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_logged(cmd: list[str], log: Path, ctx: Context, reserve_s: float = 0.0) -> dict:
    """Run `cmd` in its own process group with output to `log`, killed `reserve_s` before
    the part's deadline; returns rc and wall seconds."""
    return run_side_by_side([(cmd, log)], ctx, reserve_s)[0]


def run_side_by_side(jobs: list[tuple[list[str], Path]], ctx: Context, reserve_s: float = 0.0):
    """`run_logged` for several (cmd, log) at once, each in its own process group; all
    are killed `reserve_s` before the part's deadline."""
    env = _env_with_repo()
    t0 = time.monotonic()
    procs = []
    for cmd, log in jobs:
        with open(log, "ab") as sink:
            sink.write(f"$ {' '.join(cmd)}\n".encode())
            sink.flush()
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink,
                                          stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        # the orchestrator kills these groups too if it has to kill this part
        with open(ctx.work.parent / CHILD_GROUPS, "a") as groups:
            groups.write(f"{procs[-1].pid}\n")
    results = []
    for proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, ctx.left() - reserve_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
        results.append({"rc": rc, "wall_s": round(time.monotonic() - t0, 1)})
    return results


def read_metrics(run_dir: Path) -> list[dict]:
    from common.run_layout import METRICS, read_jsonl

    return read_jsonl(run_dir / METRICS)[0] if (run_dir / METRICS).exists() else []


def tail(path: Path, lines: int = 25) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def step_summary(metrics: list[dict], skip: int) -> dict:
    """Median tokens/s and step time after `skip` steps (compile and warm-up), peaks."""
    steps = [r for r in metrics if "loss" in r]
    timed = [r for r in steps if r["step"] > skip]
    summary: dict = {"steps_logged": len(steps)}
    if timed:
        summary["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in timed)
        summary["step_time_s"] = statistics.median(r.get("step_time_s", 0.0) for r in timed)
        summary["mfu_pct"] = statistics.median(r.get("mfu", 0.0) for r in timed)
    for key in ("memory_gib", "memory_active_gib"):
        values = [r[key] for r in steps if key in r]
        if values:
            summary[f"peak_{key}"] = max(values)
    if steps:
        summary["first_loss"], summary["last_loss"] = steps[0]["loss"], steps[-1]["loss"]
        # step 1 holds the compile (and the flex kernels' autotuning) the planner assumes
        summary["first_step_time_s"] = steps[0].get("step_time_s")
    return summary


def _gpu_kind() -> str:
    """The planner's GPU key for this card (train/plan/gpu_specs.py), "cpu" without one."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    return "h200" if "h200" in name else "h100"


def part_trainer(ctx: Context) -> dict:
    """20 steps of configs/debug.toml (FP8 rowwise, compile, async checkpoints at 10 and 20,
    validation, health, ledger, watchdog), then a second folder resumed from step 10."""
    steps = 4 if ctx.rehearse else 20
    interval = steps // 2
    sections = {
        "training": {"steps": steps},
        "checkpoint": {"interval": interval},
        "validation": {"freq": interval, "steps": 2},
        "metrics": {"log_freq": 1},
        "compile": {"enable": not ctx.rehearse},
    }
    if ctx.rehearse:  # CI's minutes: 2 sequences a step, not debug.toml's 8 micro-steps
        sections["training"] |= {"global_batch_size": 2, "seq_len": 128}
    full, resumed = ctx.work / "full", ctx.work / "resumed"
    config = write_run_config(ctx.work / "debug.toml", "debug", ctx.inputs / "data", sections)
    out: dict = {"steps": steps, "resume_from": interval}
    log = ctx.work / "trainer.log"
    first = run_logged(
        train_command(config, "--job.folder", str(full), "--fresh", "--overwrite"),
        log, ctx, reserve_s=ctx.left() * 0.4,
    )  # fmt: skip
    out["full"] = first | step_summary(read_metrics(full), 2)
    checkpoint = full / "checkpoint" / f"step-{interval}"
    if first["rc"] != 0 or not checkpoint.exists():
        out["full"]["log_tail"] = tail(log)
        out["ok"] = False
        return out
    out["full"]["checkpoints"] = sorted(p.name for p in (full / "checkpoint").glob("step-*"))
    shutil.copytree(checkpoint, resumed / "checkpoint" / checkpoint.name)
    second = run_logged(train_command(config, "--job.folder", str(resumed)), log, ctx, reserve_s=10)
    out["resumed"] = second | step_summary(read_metrics(resumed), 2)
    want = {
        r["step"]: r["loss"] for r in read_metrics(full) if "loss" in r and r["step"] > interval
    }
    got = {r["step"]: r["loss"] for r in read_metrics(resumed) if "loss" in r}
    common = sorted(set(want) & set(got))
    out["resumed"]["steps_compared"] = common
    if common:
        out["resumed"]["max_abs_loss_diff"] = max(abs(want[s] - got[s]) for s in common)
    out["ledger_verify"] = ledger_verify(full, ctx)
    if second["rc"] != 0:
        out["resumed"]["log_tail"] = tail(log)
    out["ok"] = (
        second["rc"] == 0
        and common == list(range(interval + 1, steps + 1))
        # compiled GPU kernels need not be bitwise repeatable; measured on the first GPU run
        and out["resumed"].get("max_abs_loss_diff", 1.0) < 1e-2
        and out["ledger_verify"]["rc"] == 0
    )
    return out


def ledger_verify(run: Path, ctx: Context) -> dict:
    """`python -m train.ledger verify RUN`, as a user runs it: its exit code and its end."""
    verify = subprocess.run(
        [sys.executable, "-m", "train.ledger", "verify", str(run)], cwd=REPO, capture_output=True, text=True,
        timeout=max(5.0, ctx.left()), env=_env_with_repo(),
    )  # fmt: skip
    return {"rc": verify.returncode, "output": (verify.stdout + verify.stderr)[-600:]}


# ------------------------------------------------------------------------- i. replica (issue 41)


def part_replica(ctx: Context) -> dict:
    """One replica group on this GPU, started as `scripts/replica_groups.py` starts a group
    (`python -m train` under the run's lease, the group's environment, torchft's real
    Lighthouse), whose cross-group process group is torchft's NCCL group, the trainer's
    choice where there is an accelerator (gloo on the CPU rehearsal). `groups = 2,
    min_groups = 1`: a quorum of one, as while a peer is down (two groups on one GPU would
    put two NCCL ranks on one device). Passes when its ledger holds 3 committed steps and
    verifies: on NCCL no step committed before issue 41 (a CPU tensor in a cuda-only group)."""
    import torch
    from torchft.coordination import LighthouseServer

    from common.run_layout import LEDGER, replica_dir
    from common.run_lease import LEASE_TOKEN_ENV, RunLease

    run, steps, log = ctx.work / "run", 3, ctx.work / "replica.log"
    sections = {
        "job": {"folder": str(run)},
        "training": {"steps": steps, "seq_len": 128, "global_batch_size": 2},
        "fp8": {"enable": False},
        "compile": {"enable": False},
        "validation": {"enable": False},
        "metrics": {"log_freq": 1},
        "replica_groups": {"groups": 2, "min_groups": 1, "max_retries": 3},
    }
    config = write_run_config(ctx.work / "replica.toml", "debug", ctx.inputs / "data", sections)
    cmd = train_command(config)  # first: the bridge, before train imports torchtitan
    from train.config import load_config
    from train.replica_groups.build import ft_timeouts
    from train.runtime import prepare_run_dir

    loaded = load_config(str(config))
    join_ms = int(ft_timeouts(loaded, 1).join_timeout_s * 1000)  # the launcher's Lighthouse
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=join_ms)
    lease = RunLease(run)
    try:
        with lease.held(on_lost=lambda holder: None):
            prepare_run_dir(loaded)
            # on loopback, as the launcher's (the address names the host, which a machine
            # may not resolve)
            address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
            os.environ |= {"TORCHFT_LIGHTHOUSE": address, LEASE_TOKEN_ENV: lease.me.token,
                           "TRAIN_REPLICA_GROUP": "0", "TRAIN_REPLICA_REJOIN": "0"}  # fmt: skip
            out: dict = run_logged(cmd, log, ctx, reserve_s=10)
    finally:
        lighthouse.shutdown()
    ledger = replica_dir(run, 0) / LEDGER
    records = map(json.loads, ledger.read_text().splitlines() if ledger.exists() else [])
    out["process_group"] = "nccl" if torch.cuda.is_available() else "gloo"
    committed = out["committed_steps"] = [r["step"] for r in records if r["kind"] == "step"]
    lines = tail(log, 400).splitlines()
    errors = [x for x in lines if x.startswith("error:") or ("torchft" in x and "rror" in x)]
    out["torchft_error"] = errors[-1][:600] if errors else None
    out["ledger_verify"] = ledger_verify(run, ctx)
    if out["rc"] != 0:
        out["log_tail"] = tail(log)
    out["ok"] = committed == list(range(1, steps + 1)) and out["ledger_verify"]["rc"] == 0
    return out


# ---------------------------------------------------------------------------------- f. vllm


def _vllm_stand_ins(kernel_dir: Path) -> None:
    """The few vLLM modules its three Triton attention files import, as stand-ins, with
    `vllm.v1.attention.ops` pointing at the carried kernel sources (vLLM itself is not on
    the device image, and its wheel is far over the carry limit). What the stand-ins
    answer is what vLLM answers on a CUDA machine: e4m3fn FP8, no ROCm or XPU, the real
    device capability, batch-invariant mode off."""
    import enum
    import logging
    import types

    import torch
    import triton
    import triton.language as tl

    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__path__ = []  # a package, so that submodules resolve
        sys.modules[name] = mod
        return mod

    def capability(device_id: int = 0) -> int:
        major, minor = torch.cuda.get_device_capability(device_id)
        return major * 10 + minor

    platform = types.SimpleNamespace(  # what the three files ask of vLLM's current_platform
        fp8_dtype=lambda: torch.float8_e4m3fn,
        is_rocm=lambda: False,
        is_xpu=lambda: False,
        has_device_capability=lambda cap, device_id=0: capability(device_id) >= cap,
        is_device_capability_family=lambda cap, device_id=0: (
            capability(device_id) // 10 * 10 == cap
        ),
    )

    # vllm/v1/kv_cache_interface.py's KVQuantMode, the values it uses (NONE = 0, ...)
    modes = "NONE FP8_PER_TENSOR INT8_PER_TOKEN_HEAD FP8_PER_TOKEN_HEAD INT4_PER_TOKEN_HEAD"

    module("vllm")
    module("vllm.envs", VLLM_BATCH_INVARIANT=False)
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.platforms", current_platform=platform)
    module("vllm.triton_utils", triton=triton, tl=tl, HAS_TRITON=True)
    module("vllm.utils")
    module("vllm.utils.torch_utils",
           is_quantized_kv_cache=lambda d: d.startswith("fp8") or d.endswith("per_token_head"))  # fmt: skip
    for name in ("vllm.model_executor", "vllm.model_executor.layers",
                 "vllm.model_executor.layers.quantization",
                 "vllm.model_executor.layers.quantization.utils", "vllm.v1", "vllm.v1.attention"):  # fmt: skip
        module(name)
    finfo = torch.finfo(torch.float8_e4m3fn)
    module("vllm.model_executor.layers.quantization.utils.quant_utils",
           FP8_DTYPE=torch.float8_e4m3fn, get_fp8_min_max=lambda: (finfo.min, finfo.max))  # fmt: skip
    module("vllm.v1.kv_cache_interface", KVQuantMode=enum.IntEnum("KVQuantMode", modes, start=0))
    module("vllm.v1.attention.ops").__path__ = [str(kernel_dir)]


def part_vllm(ctx: Context) -> dict:
    """vLLM 0.32's unified attention (2D prefill, 3D decode) and KV-cache writer on random
    Llama 3 8B-shaped inputs (32 heads, 8 KV heads, head_dim 128) against causal SDPA in
    fp32; the rehearsal runs the same kernels under Triton's interpreter on CPU."""
    import importlib

    import torch

    from tests.utils.paged_attention import PagedAttention, causal_sdpa

    _vllm_stand_ins(ctx.inputs / "vllm_kernels")
    if not torch.cuda.is_available():  # the rehearsal: the KV-cache writer asks for an H100's
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # tile size, as the test does
    ops = "vllm.v1.attention.ops."
    t0 = time.perf_counter()
    kernels = (
        importlib.import_module(ops + "triton_unified_attention").unified_attention,
        importlib.import_module(
            ops + "triton_reshape_and_cache_flash"
        ).triton_reshape_and_cache_flash,
    )
    device = ctx.device
    if ctx.rehearse:
        heads, kv_heads, head_dim, lens = 8, 4, 32, [20, 37]
        dtypes = {"float32": (torch.float32, 2e-5)}
    else:
        heads, kv_heads, head_dim, lens = 32, 8, 128, [37, 300, 1000]
        dtypes = {"bfloat16": (torch.bfloat16, 1e-2), "float16": (torch.float16, 2e-3)}
    decode = 2
    out: dict = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "seq_lens": lens}
    gen = torch.Generator(device=device).manual_seed(3)
    scale = head_dim**-0.5
    worst = 0.0
    for name, (dtype, tol) in dtypes.items():
        seqs = [
            tuple(torch.randn(n, h, head_dim, device=device, generator=gen).to(dtype)
                  for h in (heads, kv_heads, kv_heads))
            for n in lens
        ]  # fmt: skip
        paged = PagedAttention(kernels, lens, kv_heads, head_dim, dtype, device=device)
        prefill = [n - decode for n in lens]
        got = list(paged(
            *(torch.cat([s[j][:n] for s, n in zip(seqs, prefill, strict=True)]) for j in range(3)),
            query_lens=prefill, scale=scale,
        ).split(prefill))  # fmt: skip
        for step in range(decode):  # one token per sequence: the 3D split-softmax kernel
            at = [n + step for n in prefill]
            row = paged(
                *(torch.stack([s[j][t] for s, t in zip(seqs, at, strict=True)]) for j in range(3)),
                query_lens=[1] * len(lens), scale=scale,
            )  # fmt: skip
            got = [torch.cat([g, row[i : i + 1]]) for i, g in enumerate(got)]
        errs = [_rel_err(g, causal_sdpa(*s, scale)) for g, s in zip(got, seqs, strict=True)]
        out[f"{name}_rel_err"] = max(errs)
        out[f"{name}_tolerance"] = tol
        worst = max(worst, max(errs) / tol)
    out["first_call_s (compile)"] = time.perf_counter() - t0
    out["ok"] = worst <= 1.0
    return out


PARTS = {
    "env": part_env,
    "replica": part_replica,
    "gemm": part_gemm,
    "flex": part_flex,
    "trainer": part_trainer,
    "vllm": part_vllm,
}
