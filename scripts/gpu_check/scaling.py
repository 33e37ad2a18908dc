"""The GPU check's parts for the 70B FP8 claim, measured at the shipped layout's shapes
(issue 43); the machinery (trainer launches, timing) is `parts`'.

Why these three: the first H100 report measured FP8 GEMMs at full width (1.4-1.9x bf16) and
an 8B 2-layer step (1.07x, diluted by the bf16 `lm_head`, the whole-logits loss and the
optimizer). Neither is the claim. What makes it:
- `tp_shapes`: a compiled torchao `Float8Linear` forward and backward, casts included, at
  the per-GPU shapes the shipped layouts run: the 70B under TP 8 (N of 1,024 or 3,584, not
  8,192 or 28,672) and the 8B under FSDP alone (full width). The gain per GPU is this one.
- `layers`: our trainer at the 70B width (and the 8B's) at 1, 2 and, where the plan says
  the memory allows, 4 layers. Only the difference between depths gives one layer's cost:
  its time, its memory, its FP8/bf16 ratio (the slope); the intercept is the fixed part
  (embedding, `lm_head`, loss, optimizer). `80 x per-layer + fixed` (32 for the 8B) stands
  beside the planner's prediction for that run. Runs go in `LAYER_RUNS` order, the most
  important ratio first (bf16 against tensorwise at 1 and 2 layers, full AC), each under
  its own cap (`RUN_CAP_S`), so a call cut short still brings back that ratio; a run the
  plan says this GPU cannot hold is skipped and says so. The 8B at 2 layers is the first
  report's `step` part (which this part replaced), and one 8B run at 32,768 tokens puts
  the long-context stage's first phase beside its plan.
- `parity`: FP8 against bf16 loss over a few hundred steps of the 1B config cut to 4 layers
  (wide enough that the FP8 GEMMs are real), the same seed and data; the tolerance is the
  bf16 seed-to-seed gap of the same call (a second bf16 run with another init seed), so
  the verdict needs no constant. The three runs train side by side on the one GPU.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch_bridge
from parts import (
    LINEARS,
    Context,
    _gpu_kind,
    _rel_err,
    _time_ms,
    read_metrics,
    run_side_by_side,
    step_summary,
    tail,
    train_command,
    write_run_config,
)

# ----------------------------------------------------------------------------- tp_shapes

# (layout, linear, K (in), N (out)) per GPU; M = 8,192 tokens. TP 8 shards N of the
# column-parallel linears, K of wo and w2; the 8B under FSDP: the `gemm` part's shapes
TP_SHAPES = [
    ("70B TP 8", "wq", 8192, 1024),
    ("70B TP 8", "wk, wv", 8192, 128),
    ("70B TP 8", "wo", 1024, 8192),
    ("70B TP 8", "w1, w3", 8192, 3584),
    ("70B TP 8", "w2", 3584, 8192),
    *(("8B FSDP", linear, k, n) for model, linear, k, n in LINEARS if model == "8B"),
]
RECIPES = ("bf16", "tensorwise", "rowwise")


def part_tp_shapes(ctx: Context) -> dict:
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    device = ctx.device
    # the rehearsal: the same code eager at tiny shapes (torchao needs multiples of 16)
    m_shrink, kn_shrink = (32, 8) if ctx.rehearse else (1, 1)
    warmup, repeat = (1, 2) if ctx.rehearse else (3, 20)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for layout, name, k, n in TP_SHAPES:
        if ctx.left() < 8:
            rows.append({"layout": layout, "linear": name, "skipped": "out of time"})
            continue
        m, k, n = 8192 // m_shrink, k // kn_shrink, n // kn_shrink
        x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
        grad = torch.randn(m, n, device=device, generator=gen, dtype=torch.bfloat16)
        weight = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(torch.bfloat16)
        ref = x.float() @ weight.float().t()
        row: dict = {"layout": layout, "linear": name, "m": m, "k": k, "n": n}
        for recipe in RECIPES:
            try:
                linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
                module = torch.nn.Sequential(linear)
                module[0].weight.data.copy_(weight)
                if recipe != "bf16":
                    convert_to_float8_training(
                        module, config=Float8LinearConfig.from_recipe_name(recipe)
                    )
                if device == "cuda":
                    # a static graph per shape: left to dynamo, each new shape turns a dim
                    # dynamic, and from the fourth row on the H200 report timed dynamic-shape
                    # kernels (those rows "compiled" in milliseconds)
                    torch.compiler.reset()
                    module = torch.compile(module, dynamic=False)
                leaf = x.detach().requires_grad_()

                def fwd_bwd(module=module, leaf=leaf, grad=grad):
                    module(leaf).backward(grad)

                t0 = time.perf_counter()  # one compile: the training graph's, error and all
                y = module(leaf)
                row[f"{recipe}_rel_err"] = _rel_err(y.detach(), ref)
                y.backward(grad)
                row[f"{recipe}_first_call_s"] = time.perf_counter() - t0
                ms = _time_ms(fwd_bwd, device, warmup, repeat)
                row[f"{recipe}_ms"] = ms
                row[f"{recipe}_tflops"] = 6.0 * m * k * n / (ms * 1e-3) / 1e12
            except Exception as err:  # a recipe this build lacks is a finding, not a crash
                row[f"{recipe}_error"] = f"{type(err).__name__}: {err}"[:300]
        for recipe in RECIPES[1:]:
            if f"{recipe}_ms" in row and "bf16_ms" in row:
                row[f"{recipe}_speedup"] = row["bf16_ms"] / row[f"{recipe}_ms"]
        rows.append(row)
    return {"tokens": 8192 // m_shrink, "rows": rows, "timed_on": device,
            "compiled": device == "cuda"}  # fmt: skip


# -------------------------------------------------------------------------------- layers

# (width, recipe, AC, layers), in the order a call cut short needs them
# (the 70B config's AC choice next; the 8B at 2 layers is the first report's `step` part)
LAYER_RUNS = [
    *(("70B", r, "full", n) for n in (1, 2) for r in ("bf16", "tensorwise")),
    *(("70B", r, "selective", n) for n in (1, 2) for r in ("bf16", "tensorwise")),
    *(("8B", r, "selective", n) for n in (2, 1) for r in ("tensorwise", "bf16")),
    *(("70B", "rowwise", "full", n) for n in (1, 2)),
    *(("70B", r, "full", 4) for r in ("bf16", "tensorwise")),  # where the memory allows
    ("8B-32K", "tensorwise", "selective", 2),  # the long-context stage's first phase, no CP
]
REHEARSED_RUNS = 4  # the first four, side by side: every line of the fit and the ratio
# width -> (shipped config, full depth, seq_len)
WIDTHS = {"70B": ("llama3_70b_fp8", 80, 8192), "8B": ("llama3_8b_fp8", 32, 8192),
          "8B-32K": ("llama3_8b_fp8", 32, 32768)}  # fmt: skip
# A run's cap: the first H100 report's cold first step (64 s, compile and flex autotuning)
# and its start-up (~20 s) with room; a run whose (width, recipe, AC) compiled before
# reuses the caches (15 s first step there): the block graph is the same at every depth.
RUN_CAP_S = {"cold": 100, "warm": 60}
LAYER_STEPS, LAYER_SKIP = 6, 3
# the rehearsal's width, for `layers` and `parity` alike
TINY_MODEL = {"dim": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden_dim": 768}


def layer_key(width: str, recipe: str, ac: str, layers: int) -> str:
    return f"{width}/{recipe}/{ac}/{layers}"


def layer_sections(rehearse: bool, width: str, recipe: str, ac: str, layers: int,
                   folder: Path, steps: int) -> dict:  # fmt: skip
    """The width's shipped config at `layers` layers and its seq_len, local and global batch 1,
    one GPU (FSDP over one rank), its own flags (compile, the FP8 all-gather under
    tensorwise) but for `recipe` and `ac`; no checkpoint or validation, a metric line
    every step. The 70B's TP 8 is dropped (one GPU): its GEMMs are full width here, and
    `tp_shapes` gives the TP-8-local ratio. The rehearsal shrinks the width."""
    sections = {
        "job": {"folder": str(folder)},
        "model": {"n_layers": layers},
        "fp8": {"enable": recipe != "bf16"},
        "activation_checkpoint": {"mode": ac},
        "training": {"steps": steps, "seq_len": WIDTHS[width][2], "local_batch_size": 1,
                     "global_batch_size": 1},
        "lr_scheduler": {"warmup_steps": 2},
        "checkpoint": {"enable": False},
        "validation": {"enable": False},
        "metrics": {"log_freq": 1},
        "compile": {},
    }  # fmt: skip
    if recipe != "bf16":  # the FP8 all-gather is tensorwise's alone
        sections["fp8"] |= {"recipe": recipe, "fsdp_float8_all_gather": recipe == "tensorwise"}
    if width == "70B":
        sections["parallelism"] = {"tp": 1, "enable_sequence_parallel": False}
        sections["compile"]["async_tp"] = False
    if rehearse:
        sections["model"] |= TINY_MODEL | {"vocab_size": 2048}
        sections["training"] |= {"seq_len": 256}
        sections["compile"]["enable"] = False
    return sections


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares slope and intercept of (layers, value); None under two depths."""
    if len({x for x, _ in points}) < 2:
        return None
    return tuple(statistics.linear_regression(*zip(*points, strict=True)))


def fit_layers(runs: dict, plans: dict, seq_len: int | None = None) -> dict:
    """Per (width, recipe, AC): per-layer and fixed step time and peak reserved memory
    from the measured depths, the extrapolation to the full depth beside the plan's
    prediction for it, and the per-layer FP8/bf16 ratio."""
    groups: dict = {}
    for key, run in runs.items():
        width, recipe, ac, layers = key.split("/")
        if "step_time_s" in run:
            groups.setdefault((width, recipe, ac), []).append((int(layers), run))
    fits: dict = {}
    for (width, recipe, ac), measured in groups.items():
        time_fit = fit_line([(n, r["step_time_s"]) for n, r in measured])
        if time_fit is None:
            continue
        depth = WIDTHS[width][1]
        fit = {"depths": sorted(n for n, _ in measured), "per_layer_s": time_fit[0],
               "fixed_s": time_fit[1], "depth": depth,
               "extrapolated_step_s": depth * time_fit[0] + time_fit[1]}  # fmt: skip
        fit["extrapolated_tokens_per_s"] = (seq_len or WIDTHS[width][2]) / fit[
            "extrapolated_step_s"
        ]
        memory = fit_line(
            [(n, r["peak_memory_gib"]) for n, r in measured if "peak_memory_gib" in r]
        )
        if memory:
            fit |= {"per_layer_gib": memory[0], "fixed_gib": memory[1],
                    "extrapolated_reserved_gib": depth * memory[0] + memory[1]}  # fmt: skip
        predicted = plans.get(layer_key(width, recipe, ac, depth))
        if predicted:
            fit["predicted"] = predicted
            fit["extrapolated_over_predicted_tokens_per_s"] = (
                fit["extrapolated_tokens_per_s"] / predicted["tokens_per_s_per_gpu"]
            )
        fits[f"{width}/{recipe}/{ac}"] = fit
    for key, fit in fits.items():
        width, recipe, ac = key.split("/")
        bf16 = fits.get(f"{width}/bf16/{ac}")
        if recipe != "bf16" and bf16:
            fit["per_layer_speedup_over_bf16"] = bf16["per_layer_s"] / fit["per_layer_s"]
    return fits


def part_layers(ctx: Context) -> dict:
    import torch

    path = ctx.inputs / "plan.json"
    plan = json.loads(path.read_text()) if path.exists() else {}
    loss = _loss()
    gpu_kind = _gpu_kind()
    layers = plan.get("layers", {}).get(loss, {}).items()
    plans = {key: gpu for key, by_gpu in layers if (gpu := by_gpu.get(gpu_kind))}
    memory_gib = (
        torch.cuda.get_device_properties(0).total_memory / 2**30 if ctx.device == "cuda" else None
    )
    runs_todo = LAYER_RUNS[:REHEARSED_RUNS] if ctx.rehearse else LAYER_RUNS
    steps, skip = (2, 1) if ctx.rehearse else (LAYER_STEPS, LAYER_SKIP)
    out: dict = {"steps": steps, "timed_after_step": skip, "gpu_kind": gpu_kind, "loss": loss,
                 "seq_len": 256 if ctx.rehearse else None, "runs": {}}  # fmt: skip
    compiled, batch = set(), []  # (width, recipe, AC): one compiled block graph each
    side_by_side = REHEARSED_RUNS if ctx.rehearse else 1  # one GPU: one run at a time
    for spec in runs_todo:
        key = layer_key(*spec)
        predicted = plans.get(key)
        out["runs"][key] = {"predicted": predicted} if predicted else {}
        if memory_gib and predicted and predicted["reserved_gib"] > memory_gib:
            out["runs"][key]["skipped"] = (f"the plan's {predicted['reserved_gib']:.0f} GiB "
                                           f"reserved > this GPU's {memory_gib:.0f} GiB")  # fmt: skip
            continue
        name = key.replace("/", "_")
        config = write_run_config(
            ctx.work / f"{name}.toml", WIDTHS[spec[0]][0], ctx.inputs / "data",
            layer_sections(ctx.rehearse, *spec, ctx.work / name, steps),
        )  # fmt: skip
        batch.append((key, train_command(config, "--fresh", "--overwrite"), ctx.work / name))
        if len(batch) < side_by_side:
            continue
        cold = any(tuple(k.split("/")[:3]) not in compiled for k, _, _ in batch)
        cap = RUN_CAP_S["cold" if cold else "warm"] * (3 if ctx.rehearse else 1)
        if ctx.left() < cap / 2:
            for k, _, _ in batch:
                out["runs"][k]["skipped"] = "out of time"
            batch = []
            continue
        jobs = [(cmd, folder.with_suffix(".log")) for _, cmd, folder in batch]
        results = run_side_by_side(jobs, ctx, reserve_s=max(0.0, ctx.left() - cap))
        for (k, _, folder), result in zip(batch, results, strict=True):
            out["runs"][k] |= result | step_summary(read_metrics(folder), skip)
            if result["rc"] != 0:
                out["runs"][k]["log_tail"] = tail(folder.with_suffix(".log"), 12)
            else:
                compiled.add(tuple(k.split("/")[:3]))
        batch = []
    out["fits"] = fit_layers(out["runs"], plans, out["seq_len"])
    out["compile_s_assumed"] = next(
        (p["compile_s_assumed"] for p in plans.values() if "compile_s_assumed" in p), None
    )
    ran = [r for r in out["runs"].values() if "rc" in r]
    out["ok"] = bool(ran) and all(r["rc"] == 0 for r in ran) and bool(out["fits"])
    return out


def _loss() -> str:
    return "full_logits" if torch_bridge.trains_full_logits() else "chunked"


# -------------------------------------------------------------------------------- parity

# name -> (FP8, init seed): FP8 and bf16 from the same seed, and bf16 from another for the
# spread that is not FP8's
PARITY_RUNS = {"bf16": (False, 42), "fp8_tensorwise": (True, 42), "bf16_seed43": (False, 43)}


def parity_sections(rehearse: bool, fp8: bool, seed: int, folder: Path, steps: int) -> dict:
    """configs/llama3_1b.toml (dim 2048, FFN 8192) cut to 4 layers, the carried data's
    2,048-token vocabulary, 2 x 2,048 tokens a step, tensorwise with the bf16 `lm_head`."""
    sections = {
        "job": {"folder": str(folder)},
        "model": {"n_layers": 4, "vocab_size": 2048},
        "fp8": {"enable": fp8, "recipe": "tensorwise", "filter_fqns": ["lm_head"]},
        "training": {"steps": steps, "seq_len": 2048, "local_batch_size": 2,
                     "global_batch_size": 2, "seed": seed},
        "lr_scheduler": {"warmup_steps": steps // 10},
        "checkpoint": {"enable": False},
        "validation": {"enable": False},
        "metrics": {"log_freq": 1},
    }  # fmt: skip
    if rehearse:
        sections["model"] |= {"n_layers": 2, **TINY_MODEL}
        sections["training"] |= {"seq_len": 128}
        sections["compile"] = {"enable": False}
    return sections


def parity_verdict(curves: dict[str, list[float]], window: int) -> dict:
    """Final loss = the mean of the last `window` steps; the FP8 gap to bf16 (same seed)
    against the tolerance: the bf16 seed-to-seed gap, doubled (the same spread on either
    side of bf16's own loss)."""
    final = {name: sum(c[-window:]) / len(c[-window:]) for name, c in curves.items() if c}
    out: dict = {"final_loss": final, "window": window}
    if len(final) == len(PARITY_RUNS):
        out["fp8_gap"] = final["fp8_tensorwise"] - final["bf16"]
        out["seed_gap"] = abs(final["bf16_seed43"] - final["bf16"])
        out["tolerance"] = 2 * out["seed_gap"]
        out["within_tolerance"] = abs(out["fp8_gap"]) <= out["tolerance"]
    return out


def part_parity(ctx: Context) -> dict:
    steps = 10 if ctx.rehearse else 300
    jobs, folders = [], {}
    for name, (fp8, seed) in PARITY_RUNS.items():
        folders[name] = ctx.work / name
        config = write_run_config(
            ctx.work / f"{name}.toml", "llama3_1b", ctx.inputs / "data",
            parity_sections(ctx.rehearse, fp8, seed, folders[name], steps),
        )  # fmt: skip
        jobs.append((train_command(config, "--fresh", "--overwrite"), ctx.work / f"{name}.log"))
    results = run_side_by_side(jobs, ctx, reserve_s=5)  # one GPU, small models
    out: dict = {"steps": steps, "loss": _loss(), "runs": {}, "curves": {}}
    for (name, folder), (_, log), result in zip(folders.items(), jobs, results, strict=True):
        metrics = read_metrics(folder)
        out["curves"][name] = [r["loss"] for r in metrics if "loss" in r]
        out["runs"][name] = result | step_summary(metrics, 5)
        if result["rc"] != 0:
            out["runs"][name]["log_tail"] = tail(log, 12)
    out |= parity_verdict(out["curves"], max(3, steps // 10))
    out["ok"] = all(len(c) == steps for c in out["curves"].values()) and "fp8_gap" in out
    return out


PARTS = {"tp_shapes": part_tp_shapes, "layers": part_layers, "parity": part_parity}
