"""Every place in train/ and eval/ that asks "is there an accelerator?", listed.

One code path (issue 10): CPU runs execute what GPU runs execute, except for the true
device differences kept in `train/compat/cpu_compat.py` (see its docstring) and the serving
backend. A new fork makes this test fail, so it is added on purpose, with a reason here.
"""

from __future__ import annotations

import ast

from tests.utils.runs import REPO

FORK_CALLS = {
    "has_accelerator",  # train.compat.cpu_compat
    "cuda_available",  # eval.serve
    "torch.cuda.is_available",
    "torch.accelerator.is_available",
    "torch.cuda.device_count",
}

ALLOWED = {
    # the definition every other fork goes through
    ("train/compat/cpu_compat.py", "has_accelerator"),
    # device type/module, gloo SUM-only comms, oneDNN float8 workaround: CPU only
    ("train/compat/cpu_compat.py", "apply"),
    # torchtitan's SM89 check, passed on CPU (real float8 GEMMs via torch._scaled_mm)
    ("train/compat/cpu_compat.py", "float8_capability_check"),
    # GPUs visible but unusable by this torch (a CPU build): refuse, do not train on CPU
    ("train/compat/cpu_compat.py", "check_gpus_usable"),
    # the device "auto" is resolved for (attention: FlexAttention has no CPU backward, the
    # same mask through SDPA; param dtype: fp32 on CPU, bf16 is ~20x slower there)
    ("train/build.py", "target_has_accelerator"),
    # an AMD GPU's architecture (torch's gcnArchName): its FP8 format, fnuz on gfx942
    ("train/compat/amd_compat.py", "gcn_arch"),
    # DCP's non-blocking device-to-host staging copy needs a device
    ("train/compat/cpu_compat.py", "staging_non_blocking_copy"),
    # a replica group's gradient bucket is waited on the stream it was issued from (FSDP's
    # reduce stream on a GPU); a CPU has no streams (torchft's get_stream_context takes None)
    ("train/replica_groups/trainer.py", "GradientSum._issue"),
    # a forensics replay's plan is held against the memory of the device it runs on: a
    # GPU's own, or without one the host's RAM shared by its ranks
    ("train/forensics/plan.py", "this_device"),
    # vLLM: TRITON_ATTN on CUDA, the CPU attention backend otherwise
    ("eval/serve.py", "cuda_available"),
    ("eval/serve.py", "VLLMServer.__post_init__"),
    # vLLM's fp8 KV-cache rules differ by device: `watch --kv-cache-dtype fp8` is refused
    # before the first export, on the device the server will start on
    ("eval/watch.py", "watch"),
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _forks_in(node: ast.AST, scope: list[str]) -> set[str]:
    """Scopes ("Class.method") under `node` that call one of FORK_CALLS."""
    found = set()
    for child in ast.iter_child_nodes(node):
        inner = scope
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            inner = [*scope, child.name]
        if isinstance(child, ast.Call):
            name = _dotted(child.func)
            if name in FORK_CALLS or name.split(".")[-1] in FORK_CALLS:
                found.add(".".join(scope) or "<module>")
        found |= _forks_in(child, inner)
    return found


def fork_points() -> set[tuple[str, str]]:
    found = set()
    for package in ("train", "eval"):
        for path in sorted((REPO / package).rglob("*.py")):
            relative = str(path.relative_to(REPO))
            found |= {(relative, s) for s in _forks_in(ast.parse(path.read_text()), [])}
    return found


def test_device_forks_are_only_the_listed_ones():
    found = fork_points()
    assert found - ALLOWED == set(), (
        "new accelerator check(s): keep one code path, or add a true device difference to "
        f"ALLOWED with its reason: {sorted(found - ALLOWED)}"
    )
    assert ALLOWED - found == set(), f"listed forks no longer exist: {sorted(ALLOWED - found)}"
