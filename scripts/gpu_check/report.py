"""The GPU check's report: `report.json` as the parts returned it, and a markdown summary
that a reader can take in at a glance (committed under docs/bench/gpu/ after a real run)."""

from __future__ import annotations

import json


def _f(value, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if abs(value) >= 0.01 or value == 0 else f"{value:.1e}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)  # None, a bool, a string


def summary_table(report: dict) -> str:
    rows = ["part      ok     seconds  note"]
    for name, result in report["parts"].items():
        note = result.get("error", "")[:70]
        rows.append(f"{name:<9} {'yes' if result.get('ok') else 'NO':<6} "
                    f"{_f(result.get('seconds')):>7}  {note}")  # fmt: skip
    return "\n".join(rows)


def _env(r: dict) -> list[str]:
    lines = [f"- GPU: {r.get('gpu', 'none')} ({_f(r.get('gpu_memory_gib'))} GiB, capability "
             f"{r.get('capability')}, {r.get('multiprocessors')} SMs), driver {r.get('driver')}",
             f"- Python {r.get('python')}, torch {r.get('torch')} (CUDA {r.get('cuda_runtime')}), "
             f"triton {r.get('triton')}, {r.get('cpu_count')} CPUs", "",
             "| package | pinned | here | same |", "| --- | --- | --- | --- |"]  # fmt: skip
    for p in r.get("pins", []):
        lines.append(
            f"| {p['package']} | {p['pinned']} | {p['here']} | {'yes' if p['match'] else '**no**'} |"
        )
    gaps = "; ".join(r.get("bridged_gaps") or []) or "none"
    lines += ["", f"Gaps to the pinned torch filled by scripts/gpu_check/torch_bridge.py: {gaps}"]
    return lines


def _cell(row: dict, v: str) -> str:
    """TFLOP/s of variant `v` (x bf16), or its error."""
    if f"{v}_error" in row:
        return f"error: {row[f'{v}_error'][:60]}"
    out = _f(row.get(f"{v}_tflops"), 0)
    return out + (f" ({_f(row[f'{v}_speedup'])}×)" if f"{v}_speedup" in row else "")


def _linear_rows(r: dict, name: str, variants: tuple, tail) -> list[str]:
    """A row per linear: its shape, its TFLOP/s per variant, then the cells `tail(row)`."""
    lines = []
    for row in r.get("rows", []):
        head = f"| {row[name]} | {row['linear']} |"
        if "skipped" in row:
            lines.append(f"{head} skipped: {row['skipped']} |")
            continue
        cells = [f"{row['k']} × {row['n']}", *(_cell(row, v) for v in variants)]
        lines.append(f"{head} {' | '.join(cells + tail(row))} |")
    return lines


def _gemm(r: dict) -> list[str]:
    lines = [f"M = {r.get('tokens')} tokens, timed on {r.get('timed_on')}; error = "
             "‖C − C_fp32‖ / ‖C_fp32‖ on random inputs", "",
             "| model | linear | K × N | bf16 TFLOP/s | tensorwise TFLOP/s (× bf16) | rowwise "
             "TFLOP/s (× bf16) | err bf16 | err tensorwise | err rowwise |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    variants = ("bf16", "fp8_tensorwise", "fp8_rowwise")
    return lines + _linear_rows(
        r, "model", variants, lambda row: [_f(row.get(f"{v}_rel_err")) for v in variants]
    )


def _tp_shapes(r: dict) -> list[str]:
    lines = [f"M = {r.get('tokens')} tokens; a torchao `Float8Linear` forward and backward, casts "
             f"included ({'compiled' if r.get('compiled') else 'eager'}), on {r.get('timed_on')}; "
             "TFLOP/s of the three GEMMs; error of the forward against fp32", "",
             "| layout | linear | K × N | bf16 TFLOP/s | tensorwise (× bf16) | rowwise (× bf16) | "
             "err tensorwise | err rowwise | first call s (tensorwise) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    return lines + _linear_rows(r, "layout", ("bf16", "tensorwise", "rowwise"), lambda row: [
        _f(row.get("tensorwise_rel_err")), _f(row.get("rowwise_rel_err")),
        _f(row.get("tensorwise_first_call_s"), 1)])  # fmt: skip


def _loss(r: dict) -> str:
    if r.get("loss") == "full_logits":  # the chunked loss where the device's torch allows it
        return "full logits (the chunked loss's FSDP2 backward needs torch 2.13: torch_bridge.py, gap 3)"
    return str(r.get("loss"))


def _layers(r: dict) -> list[str]:
    lines = [f"Our trainer at seq {r.get('seq_len') or '8,192 (32,768: 8B-32K)'}, batch 1, one GPU, {r.get('steps')} steps a run, "
             f"medians after step {r.get('timed_after_step')}, loss {_loss(r)}; predictions: "
             f"the planner on the same run for `{r.get('gpu_kind')}` "
             "(scripts/gpu_check/prepare.py). Memory: peak reserved.", "",
             "| run (width/recipe/AC/layers) | rc | step s | predicted | tokens/s | peak GiB | "
             "predicted GiB | first step s | wall s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for key, v in r.get("runs", {}).items():
        p = v.get("predicted") or {}
        if "skipped" in v:
            lines.append(f"| {key} | skipped: {v['skipped']} |")
            continue
        lines.append(f"| {key} | {v.get('rc')} | {_f(v.get('step_time_s'), 3)} | {_f(p.get('step_s'), 3)} | "
                     f"{_f(v.get('tokens_per_s'), 0)} | {_f(v.get('peak_memory_gib'))} | "
                     f"{_f(p.get('reserved_gib'))} | {_f(v.get('first_step_time_s'), 1)} | {_f(v.get('wall_s'), 0)} |")  # fmt: skip
    lines += ["", f"Cold first step (compile) beside the planner's assumed {r.get('compile_s_assumed')} s: "
              "the first run's first step above.", "",
              "| width/recipe/AC | depths | per-layer s | fixed s | FP8/bf16 per layer | per-layer GiB | "
              "fixed GiB | depth | depth × per-layer + fixed: step s (tokens/s) | predicted step s "
              "(tokens/s) | GiB extrapolated | GiB predicted |", "| --- " * 12 + "|"]  # fmt: skip
    for key, f in r.get("fits", {}).items():
        p = f.get("predicted") or {}
        lines.append(f"| {key} | {f['depths']} | {_f(f['per_layer_s'], 4)} | {_f(f['fixed_s'], 4)} | "
                     f"{_f(f.get('per_layer_speedup_over_bf16'))} | {_f(f.get('per_layer_gib'))} | "
                     f"{_f(f.get('fixed_gib'))} | {f['depth']} | {_f(f['extrapolated_step_s'], 2)} "
                     f"({_f(f['extrapolated_tokens_per_s'], 0)}) | {_f(p.get('step_s'), 2)} "
                     f"({_f(p.get('tokens_per_s_per_gpu'), 0)}) | {_f(f.get('extrapolated_reserved_gib'), 0)} | "
                     f"{_f(p.get('reserved_gib'), 0)} |")  # fmt: skip
    for key, v in r.get("runs", {}).items():
        if v.get("log_tail"):
            lines += ["", f"{key} log tail:", "```text", v["log_tail"], "```"]
    return lines


def _parity(r: dict) -> list[str]:
    final = r.get("final_loss", {})
    lines = [f"configs/llama3_1b.toml cut to 4 layers, {r.get('steps')} steps, the same data; loss "
             f"{_loss(r)}. Final loss: the mean of the last {r.get('window')} steps.", "",
             "| run | final loss | rc | step s | wall s |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, v in r.get("runs", {}).items():
        lines.append(f"| {name} | {_f(final.get(name), 4)} | {v.get('rc')} | "
                     f"{_f(v.get('step_time_s'), 3)} | {_f(v.get('wall_s'), 0)} |")  # fmt: skip
    if "fp8_gap" in r:
        lines += ["", f"FP8 − bf16 (same seed): {_f(r['fp8_gap'], 4)}; tolerance {_f(r['tolerance'], 4)} "
                  f"(twice the bf16 seed-to-seed gap {_f(r['seed_gap'], 4)}): "
                  f"**{'within' if r['within_tolerance'] else 'OUTSIDE'}**."]  # fmt: skip
    curves = r.get("curves", {})
    n = max((len(c) for c in curves.values()), default=0)
    lines += ["", "| step | " + " | ".join(curves) + " |", "| --- " * (len(curves) + 1) + "|"]
    for i in sorted({*range(0, n, max(1, n // 10)), n - 1} - {-1}):
        cells = (_f(c[i], 3) if i < len(c) else "" for c in curves.values())
        lines.append(f"| {i + 1} | {' | '.join(cells)} |")
    return lines


def _generic(r: dict) -> list[str]:
    shown = {k: v for k, v in r.items() if k not in ("ok", "seconds", "error")}
    return ["```json", json.dumps(shown, indent=1, default=str)[:6000], "```"]


SECTIONS = {"env": _env, "gemm": _gemm, "tp_shapes": _tp_shapes, "layers": _layers,
            "parity": _parity}  # fmt: skip
TITLES = {
    "env": "a. Environment",
    "tp_shapes": "g. FP8 linears at the shipped layouts' per-GPU shapes",
    "layers": "c. Layer by layer: per-layer and fixed costs, extrapolated to full depth",
    "parity": "h. FP8 against bf16 loss",
    "gemm": "b. FP8 GEMMs",
    "flex": "d. Document-masked FlexAttention",
    "trainer": "e. Our trainer on the device",
    "vllm": "f. vLLM's Triton attention kernel",
    "replica": "i. One replica group over torchft's NCCL group",
}


def markdown(report: dict) -> str:
    kind = "CPU rehearsal (no timing claims)" if report["rehearsal"] else "real run"
    lines = [
        f"# GPU check, {report['date'][:10]}: {report.get('gpu', 'no GPU')}",
        "",
        f"{kind}; commit {report['commit']}; {report['wall_s']} s in all "
        f"(caps {sum(report['caps_s'].values())} s). Made by `python scripts/gpu_check run` "
        '(docs/testing.md, "The GPU check").',
        "",
        "```text",
        summary_table(report),
        "```",
    ]
    for name, result in report["parts"].items():
        lines += ["", f"## {TITLES.get(name, name)}", ""]
        if result.get("error"):
            lines += [f"**Failed:** `{result['error']}`", ""]
        try:
            lines += SECTIONS.get(name, _generic)(result)
        except Exception as err:  # a report must never hide the numbers behind a bug
            lines += [f"(summary failed: {err})", *_generic(result)]
    return "\n".join(lines) + "\n"
