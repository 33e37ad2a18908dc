"""The GPU check's report: `report.json` as the parts returned it, and a markdown summary
that a reader can take in at a glance (committed under docs/bench/gpu/ after a real run)."""

from __future__ import annotations

import json


def _f(value, digits: int = 2) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if abs(value) >= 0.01 or value == 0 else f"{value:.1e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


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
    gaps = r.get("bridged_gaps") or []
    lines.append("")
    lines.append("Gaps to the pinned torch filled by scripts/gpu_check/torch_bridge.py: "
                 + ("; ".join(gaps) if gaps else "none"))  # fmt: skip
    return lines


def _gemm(r: dict) -> list[str]:
    lines = [f"M = {r.get('tokens')} tokens, timed on {r.get('timed_on')}; error = "
             "‖C − C_fp32‖ / ‖C_fp32‖ on random inputs", "",
             "| model | linear | K × N | bf16 TFLOP/s | tensorwise TFLOP/s (× bf16) | rowwise "
             "TFLOP/s (× bf16) | err bf16 | err tensorwise | err rowwise |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in r.get("rows", []):
        if "skipped" in row:
            lines.append(f"| {row['model']} | {row['linear']} | skipped: {row['skipped']} |")
            continue

        def cell(v, row=row):
            if f"{v}_error" in row:
                return f"error: {row[f'{v}_error'][:60]}"
            out = _f(row.get(f"{v}_tflops"), 0)
            return out + (f" ({_f(row[f'{v}_speedup'])}×)" if f"{v}_speedup" in row else "")

        lines.append(
            f"| {row['model']} | {row['linear']} | {row['k']} × {row['n']} | {cell('bf16')} | "
            f"{cell('fp8_tensorwise')} | {cell('fp8_rowwise')} | {_f(row.get('bf16_rel_err'))} | "
            f"{_f(row.get('fp8_tensorwise_rel_err'))} | {_f(row.get('fp8_rowwise_rel_err'))} |"
        )
    return lines


def _step(r: dict) -> list[str]:
    lines = [f"{r.get('steps')} steps per run, medians after step {r.get('timed_after_step')}; "
             f"prediction: `python -m train --dry-run --world-size 1 --gpu {r.get('gpu_kind')}` "
             "on the same config (scripts/gpu_check/prepare.py)", "",
             "| variant | rc | tokens/s | predicted | measured / predicted | step s | MFU % | "
             "peak reserved GiB | predicted GiB | peak allocated GiB | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, v in r.get("variants", {}).items():
        p = v.get("predicted") or {}
        lines.append(
            f"| {name} | {v.get('rc')} | {_f(v.get('tokens_per_s'), 0)} | "
            f"{_f(p.get('tokens_per_s_per_gpu'), 0)} | {_f(v.get('measured_over_predicted_tokens_per_s'))} | "
            f"{_f(v.get('step_time_s'), 3)} | {_f(v.get('mfu_pct'), 1)} | {_f(v.get('peak_memory_gib'))} | "
            f"{_f(p.get('reserved_gib'))} | {_f(v.get('peak_memory_active_gib'))} | {_f(v.get('wall_s'), 0)} |"
        )
    if "fp8_over_bf16_tokens_per_s" in r:
        lines += ["", f"FP8 / bf16 tokens/s: {_f(r['fp8_over_bf16_tokens_per_s'])}"]
    for name, v in r.get("variants", {}).items():
        if v.get("log_tail"):
            lines += ["", f"{name} log tail:", "```text", v["log_tail"], "```"]
    return lines


def _generic(r: dict) -> list[str]:
    shown = {k: v for k, v in r.items() if k not in ("ok", "seconds", "error")}
    return ["```json", json.dumps(shown, indent=1, default=str)[:6000], "```"]


SECTIONS = {"env": _env, "gemm": _gemm, "step": _step}
TITLES = {
    "env": "a. Environment",
    "gemm": "b. FP8 GEMMs",
    "flex": "d. Document-masked FlexAttention",
    "step": "c. A training step at real shapes",
    "trainer": "e. Our trainer on the device",
    "vllm": "f. vLLM's Triton attention kernel",
}


def markdown(report: dict) -> str:
    kind = "CPU rehearsal (no timing claims)" if report["rehearsal"] else "real run"
    env = report["parts"].get("env", {})
    lines = [
        f"# GPU check, {report['date'][:10]}: {env.get('gpu', 'no GPU')}",
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
