"""The plan against published runs: predicted vs published tokens/s/GPU and reserved memory.

Why a benchmark and not a claim: the dry run's time model (train/plan/time_model.py) has
constants fitted to published runs, so its error on those runs says little; what says how
far to trust a prediction is the error on a run the constants never saw. This script plans
every published configuration of `train.plan.calibration.PUBLISHED` at its exact layout
(the tracer on a fake process group of the run's world size), fits the constants without
each row in turn (leave-one-out), predicts that row, and writes the table with the mean
absolute errors to docs/bench/plan_published-DATE.md. tests/train/plan/test_plan_published.py
recomputes the same errors in CI and fails if they grow.

    python scripts/bench_plan.py [--out docs/bench/plan_published-2026-11-24.md]

`--suggest` instead asks `python -m train --dry-run --suggest` (train/plan/suggest.py) for
each published row's model, GPUs, seq_len and global batch, and writes its pick beside the
layout the publishers used (docs/bench/plan_suggest-DATE.md).

    python scripts/bench_plan.py --suggest [--out docs/bench/plan_suggest-2026-11-24.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

from common.io import write_text_atomic
from common.noise import filter_known_noise

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from bench_train import device_name, versions  # noqa: E402

DATE = "2026-11-24"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:+.1%}"


def to_markdown(check, seconds: float, traces: int, machine: str) -> str:
    from train.plan.calibration import PRIORS
    from train.plan.time_model import TimeConstants

    c = check.constants
    lines = [
        f"# The plan against published runs, {DATE}",
        "",
        f"- machine: {machine}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in versions().items())}",
        f"- date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%dT%H:%M:%S')} UTC",
        "- command: `python scripts/bench_plan.py` (rows: `train/plan/calibration.py`)",
        f"- cost: {traces} distinct steps traced for {len(check.rows)} rows in {seconds:.0f} s;"
        " the fits and leave-one-out: under 15 s",
        "",
        "Each row is planned at the published configuration (world size, degrees, local batch,",
        "seq_len, AC, compile, FP8 recipe) on a fake process group, with the loss on the whole",
        "logits as torchtitan then computed it. **Predicted** is leave-one-out: the constants",
        "that predict a row were fitted to the other rows only. Memory is peak reserved (GiB).",
        "",
        f"**Leave-one-out mean absolute error: {check.tps_mae:.1%} on tokens/s/GPU, "
        f"{check.memory_mae:.1%} on reserved memory** (targets 15 % and 10 %; "
        f"{sum(r.exact for r in check.rows)} rows, "
        f"{sum(r.exact and r.memory_gib is not None for r in check.rows)} with memory).",
        "",
        "| row | GPUs | layout | batch x seq | AC, compile, FP8 | tokens/s published |"
        " predicted | error | memory published | predicted | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in check.rows:
        tokens, reserved = check.predictions[row.name]
        layout = f"FSDP {row.dp_shard}" + f" x TP {row.tp}" * (row.tp > 1)
        layout += f" x CP {row.cp}" * (row.cp > 1) + ", async TP" * row.async_tp
        fp8 = (row.fp8 or "bf16") + " + FP8 all-gather" * (row.fp8 != "" and row.fp8_all_gather)
        settings = f"{row.ac}, {'compile' if row.compile else 'eager'}, {fp8}"
        memory = f"{row.memory_gib:.1f}" if row.memory_gib is not None else "-"
        predicted_memory = f"{reserved:.1f}" if row.memory_gib is not None else "-"
        name = row.name if row.exact else f"{row.name} (not in the error: guessed layout)"
        lines.append(
            f"| {name} | {row.world_size} x {row.gpu} | {layout} | {row.local_batch} x "
            f"{row.seq_len} | {settings} | {row.tokens_per_s:,.0f} | {tokens:,.0f} | "
            f"{_pct(check.tps_loo[row.name])} | {memory} | {predicted_memory} | "
            f"{_pct(check.memory_loo.get(row.name))} |"
        )
    lines += ["", "Sources and what each row assumes:", ""]
    for row in check.rows:
        lines.append(f"- `{row.name}`: {row.source}" + (f"; {row.assumed}" if row.assumed else ""))
    outside_tps = [r for r in check.rows if r.exact and abs(check.tps_loo[r.name]) > 0.15]
    outside_mem = [r for r in check.rows if abs(check.memory_loo.get(r.name, 0)) > 0.10]
    lines += ["", "## Rows outside the targets, and why", ""]
    for row in outside_tps:
        lines.append(
            f"- `{row.name}` tokens/s {_pct(check.tps_loo[row.name])}: {WHY.get(row.name, WHY_DEFAULT)}"
        )
    for row in outside_mem:
        lines.append(
            f"- `{row.name}` memory {_pct(check.memory_loo[row.name])}: {WHY.get(row.name + ' memory', WHY_DEFAULT)}"
        )
    lines += [
        "",
        "## The constants (fitted to all rows above, from their priors)",
        "",
        "| constant | prior | fitted | what it is |",
        "| --- | --- | --- | --- |",
    ]
    for name, doc in CONSTANT_DOCS.items():
        lines.append(f"| `{name}` | {getattr(PRIORS, name):g} | {getattr(c, name):.4g} | {doc} |")
    defaults = TimeConstants()
    same = all(abs(getattr(defaults, n) - getattr(c, n)) < 5e-4 for n in CONSTANT_DOCS)
    lines += [
        "",
        "`train/plan/time_model.py`'s `TimeConstants` defaults "
        + ("are this fit." if same else "DIFFER from this fit: update them."),
        "",
    ]
    return "\n".join(lines)  # fmt: skip


WHY_DEFAULT = "no specific cause found; the model's constants are shared by every row"
WHY = {
    "tt25-8b-rowwise": "torchtitan's own note calls this rowwise + TP baseline slow, a bug "
    "being fixed (pytorch/torchtitan#1207); the model's rowwise GEMM efficiency, fitted "
    "mostly on the 70B rows, does not carry that bug",
    "tt25-8b-rowwise-async": "as the row above (pytorch/torchtitan#1207)",
    "tt-8b-64k-cp2": "the published CP was torch's ring attention over SDPA (Dec 2024); the "
    "model has one attention efficiency for every length and CP degree, fitted mostly at "
    "128K and 256K, where the 64K row runs faster than it predicts",
    "trainy-8b-32-h200 memory": "Trainy ran with force_recompute_fp8_weight_in_bwd and "
    "torchtitan of June 2025; their 48 GiB is 30 GiB below torchtitan's own Dec 2024 figure "
    "for the same 8B layout and batch (77 GiB), which the model follows",
    "trainy-8b-64-h200 memory": "as the row above",
}
CONSTANT_DOCS = {
    "gemm_efficiency": "share of the bf16 / FP8 (tensorwise) GEMM peak achieved",
    "rowwise_gemm_efficiency": "share of the FP8 peak by GEMMs with per-row scales",
    "attention_efficiency": "share of the bf16 peak by the attention kernels",
    "compiled_traffic": "share of the traced eager memory-bound bytes compiled code moves",
    "eager_traffic": "share of the traced eager bytes an eager GPU run moves",
    "link_efficiency": "NCCL ring bandwidth / link peak (NVLink and network)",
    "async_tp_hidden": "share of TP collectives async TP hides",
    "allocator_overhead": "reserved / allocated - 1 at the peak",
    "compiled_activations": "compiled activations / eager-traced activations",
}


def suggest_markdown(rows: list[dict], machine: str, seconds: float) -> str:
    """The pick of `--suggest` beside the publishers' layout, per published row."""
    lines = [
        f"# The suggested layout against the published one, {DATE}",
        "",
        f"- machine: {machine}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in versions().items())}",
        f"- date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%dT%H:%M:%S')} UTC",
        "- command: `python scripts/bench_plan.py --suggest` (rows: `train/plan/calibration.py`)",
        f"- cost: {seconds:.0f} s for {len(rows)} rows, one process per group of rows that trace"
        " alike (they share their traces)",
        "",
        "For each published run, `--dry-run --suggest` is asked for the run's model, GPU kind and",
        "count, seq_len, global batch (local x data-parallel degree, as published) and FP8,",
        "compile and async-TP settings, with this trainer's chunked loss (the published runs",
        "computed the loss on the whole logits, which holds several GiB more at 8K x 128K",
        "vocabulary). Each estimate is the suggestion's (scaled from traced references,",
        'docs/dry_run.md "Suggest a layout"), the publishers\' layout scored the same way;',
        '"rank" is its place among the layouts that fit.',
        "",
        "| row | GPUs | seq x global batch | published layout | published tokens/s | its estimate"
        " (rank) | pick | pick's estimate | pick's reserved GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['name']} | {r['gpus']} | | | | suggest failed: {r['error']} | | | |"
            )
            continue
        lines.append(
            f"| {r['name']} | {r['gpus']} | {r['seq']} x {r['global']} | {r['own']} | "
            f"{r['published']:,.0f} | {r['own_tokens']:,.0f} ({r['own_rank']}) | {r['pick']} | "
            f"{r['pick_tokens']:,.0f} | {r['pick_gib']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _suggest_rows(names: list[str]) -> list[dict]:
    """Suggest for each named published row (rows that trace alike), in this process."""
    from train.plan.calibration import PUBLISHED
    from train.plan.step_counts import GIB
    from train.plan.suggest import suggest
    from train.runtime import prepare_runtime

    filter_known_noise()
    prepare_runtime()
    cache: dict = {}
    out = []
    for row in (r for r in PUBLISHED if r.name in names):
        entry = {"name": row.name, "gpus": f"{row.world_size} x {row.gpu}"}
        try:
            result = suggest(row.run_config(), row.world_size, row.gpu, cache)
        except Exception as e:  # a failed trace is reported in its row, the others go on
            entry["error"] = " ".join(str(e).split())[:120]
            out.append(entry)
            continue
        i, own = next((i, s) for i, s in enumerate(result.ranked) if s.candidate == result.own)
        pick = result.fitting[0]
        entry |= {
            "seq": row.seq_len, "global": result.global_batch_size, "own": result.own.short(),
            "published": row.tokens_per_s, "own_tokens": own.tokens_per_s_per_gpu,
            "own_rank": f"#{i + 1}" if own.report.fits else "does not fit",
            "pick": pick.candidate.short(), "pick_tokens": pick.tokens_per_s_per_gpu,
            "pick_gib": pick.report.peak / GIB, "seconds": result.elapsed_s,
        }  # fmt: skip
        out.append(entry)
    return out


def run_suggest_bench(out: Path) -> int:
    """Each group of rows that trace alike in a fresh process: the traced trainers of
    several layouts in one process can trip over torch's cached process-group names."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from train.plan.calibration import PUBLISHED

    start = time.perf_counter()
    groups: dict[tuple, list[str]] = {}
    for row in PUBLISHED:
        key = (row.model, row.world_size, row.seq_len, row.local_batch * row.dp_shard,
               row.fp8, row.fp8_all_gather)  # fmt: skip
        groups.setdefault(key, []).append(row.name)
    rows: dict[str, dict] = {}
    context = multiprocessing.get_context("spawn")
    for names in groups.values():
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            for entry in pool.submit(_suggest_rows, names).result():
                rows[entry["name"]] = entry
                print(f"{entry['name']}: {entry.get('seconds', 0):.0f} s "
                      f"{entry.get('error', '')}", flush=True)  # fmt: skip
    ordered = [rows[r.name] for r in PUBLISHED]
    text = suggest_markdown(ordered, device_name(), time.perf_counter() - start)
    write_text_atomic(out, text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--suggest", action="store_true", help="each published row's pick beside its layout"
    )
    args = parser.parse_args(argv)
    filter_known_noise()
    from train.runtime import prepare_runtime

    prepare_runtime()
    bench = "plan_suggest" if args.suggest else "plan_published"
    out = Path(args.out or REPO / "docs" / "bench" / f"{bench}-{DATE}.md")
    if args.suggest:
        return run_suggest_bench(out)
    from train.plan.calibration import PUBLISHED, leave_one_out, trace_rows

    start = time.perf_counter()
    counts = trace_rows(PUBLISHED)
    seconds = time.perf_counter() - start
    traces = len({id(c) for c in counts.values()})
    check = leave_one_out(PUBLISHED, counts)
    text = to_markdown(check, seconds, traces, device_name())
    write_text_atomic(out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
