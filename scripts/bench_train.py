"""Training throughput benchmark: BF16 vs FP8 (tensorwise, rowwise) on the same shapes.

Why a harness and not a number in a README: FP8's gain depends on the shapes (small GEMMs
lose to the cast overhead), on compile (the casts must fuse) and on the machine, so the
claim "FP8 is N% faster" is only worth the command that reproduces it. This script runs
the real training entry point (`torchrun -m train`) once per variant with identical
shapes, data and steps, reads each run's `RUN/metrics.jsonl`, and writes the comparison
with the device, versions, date and exact commands to `docs/bench/`.

What is reported per variant (steps after `--warmup` only):
- median tokens/s per GPU (torchtitan's `throughput(tps)`, already per device),
- MFU against the dense BF16 peak as torchtitan counts it (`mfu`), and against the FP8
  peak (twice the BF16 one on Hopper/Blackwell), so FP8 is not flattered by a BF16 peak,
- peak memory (`memory_gib`: torchtitan's max reserved; on CPU the shimmed host number),
- data-wait share: seconds waiting on the loader over seconds of step time,
- ratios against BF16.

`--preset gpu8b` is the GPU target: the Llama 3 8B layer shape (dim 4096, FFN 14336,
32 heads, 8 KV heads) on `configs/llama3_8b_fp8.toml`, seq_len 8192, compile on, and as many
layers as the dry-run planner (`train.plan.dry_run`) says fit the GPUs.

    python scripts/bench_train.py --preset gpu8b --data DATA --nproc 1 --steps 30
    python scripts/bench_train.py --config configs/debug.toml --data DATA --steps 8 \\
        --warmup 3 --name train_cpu_tiny -- --model.n_layers 2
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from pathlib import Path

from common.run_layout import read_metrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import bench_common  # noqa: E402

# variant name -> overrides (the FP8 recipes are torchao's; tensorwise adds FP8 all-gather)
VARIANTS: dict[str, list[str]] = {
    "bf16": ["--fp8.enable", "false"],
    "fp8_tensorwise": ["--fp8.enable", "true", "--fp8.recipe", '"tensorwise"'],
    "fp8_rowwise": ["--fp8.enable", "true", "--fp8.recipe", '"rowwise"'],
}

# FP8 tensor-core peak over the dense BF16 peak torchtitan uses (H100/H200/B200 datasheets)
FP8_PEAK_OVER_BF16 = 2.0

PRESETS: dict[str, dict] = {
    "gpu8b": {
        "config": "configs/llama3_8b_fp8.toml",
        "overrides": [
            "--model.dim=4096",
            "--model.ffn_hidden_dim=14336",
            "--model.n_heads=32",
            "--model.n_kv_heads=8",
            "--training.seq_len=8192",
            "--training.local_batch_size=1",
            "--training.global_batch_size=-1",
            "--compile.enable=true",
        ],
        "max_layers": 32,
    },
}


def layers_that_fit(config: str, overrides: list[str], world_size: int, gpu: str, most: int) -> int:
    """The largest n_layers the dry-run planner says fits `gpu` (bisection on meta)."""
    import contextlib
    import io

    from train.config import load_config
    from train.plan.dry_run import run_dry
    from train.runtime import prepare_runtime

    prepare_runtime()

    def fits(n_layers: int) -> bool:
        run = load_config(REPO / config, [*overrides, "--model.n_layers", str(n_layers)])
        with contextlib.redirect_stdout(io.StringIO()):
            return run_dry(run, world_size, gpu) == 0

    # the first layer count that does not fit, by bisection (fitting is monotone in layers)
    fitting = bisect.bisect_left(range(1, most + 1), True, key=lambda n: not fits(n))
    if not fitting:
        raise ValueError(
            f"even one layer of {config} does not fit {gpu} at world size {world_size}"
        )
    return fitting


def measured_steps(run_dir: Path, warmup: int) -> list[dict]:
    """The training steps after `warmup` that RUN/metrics.jsonl logged."""
    rows, _ = read_metrics(run_dir)
    steps = [r for r in rows if "tokens_per_s" in r and r["step"] > warmup]
    if not steps:
        raise RuntimeError(f"{run_dir}: no logged step after warmup {warmup}; raise --steps")
    return steps


def summarize(name: str, command: str, rows: list[dict]) -> dict:
    step_time = sum(r["step_time_s"] for r in rows)
    mfu = statistics.median(r["mfu"] for r in rows)
    return {
        "name": name,
        "command": command,
        "num_measured_steps": len(rows),
        "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s"] for r in rows),
        "mfu_bf16_peak_pct": mfu,
        "mfu_fp8_peak_pct": mfu / FP8_PEAK_OVER_BF16,
        "peak_memory_gib": max(r["memory_gib"] for r in rows),
        "data_wait_share": sum(r["data_wait_s"] for r in rows) / step_time if step_time else 0.0,
        "final_loss": rows[-1]["loss"],
    }


def run_variant(name: str, config: str, common: list[str], nproc: int, work: Path, timeout: float):
    """Train one variant under torchrun into work/name; returns the exact command."""
    folder = json.dumps(str(work / name))
    args = ["--config", config, *common, *VARIANTS[name], "--job.folder", folder]
    return bench_common.torchrun(nproc, ["-m", "train", *args], work / f"{name}.log", timeout)


def to_markdown(report: dict) -> str:
    base = report["results"][0]
    lines = [
        *bench_common.report_header(report, f"Training benchmark: {report['name']}"),
        f"- {report['nproc']} rank(s), {report['steps']} steps, first {report['warmup']} "
        "excluded; medians over the rest",
        f"- command: `{report['command']}`",
        f"- the bf16 variant is the run without FP8; its parameter dtype here: "
        f"{report['baseline_param_dtype']}",
        "- MFU uses torchtitan's dense BF16 peak for the device (meaningless on CPU); "
        f"the FP8 column divides by {report['fp8_peak_over_bf16']:g}x that peak",
        "",
        "| variant | tokens/s/GPU | vs BF16 | MFU (BF16 peak) | MFU (FP8 peak) "
        "| peak mem GiB | vs BF16 | data wait | final loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['name']} | {r['tokens_per_s_per_gpu']:,.0f} "
            f"| {r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x "
            f"| {r['mfu_bf16_peak_pct']:.2f}% | {r['mfu_fp8_peak_pct']:.2f}% "
            f"| {r['peak_memory_gib']:.2f} "
            f"| {r['peak_memory_gib'] / base['peak_memory_gib']:.2f}x "
            f"| {r['data_wait_share']:.1%} | {r['final_loss']:.3f} |"
        )
    lines += ["", "Per-variant commands:", ""]
    lines += [f"- {r['name']}: `{r['command']}`" for r in report["results"]]
    return "\n".join(lines) + "\n"


def bench(args: argparse.Namespace, extra: list[str], raw_argv: list[str]) -> int:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        raise ValueError(f"--variants {unknown or '(empty)'}: choose from {', '.join(VARIANTS)}")
    if variants[0] != "bf16":
        raise ValueError("--variants must start with bf16: the ratios are relative to it")
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup {args.warmup} must be below --steps {args.steps}")
    preset = PRESETS[args.preset] if args.preset else None
    config = args.config or (preset["config"] if preset else None)
    if config is None:
        raise ValueError("give --config or --preset")
    overrides = [*bench_common.data_overrides(args.data), *(preset or {}).get("overrides", [])]
    overrides += extra

    import torch  # after the checks: a user error costs no torch import

    nproc = args.nproc or max(1, torch.cuda.device_count())
    if preset and "--model.n_layers" not in extra:
        n_layers = layers_that_fit(config, overrides, nproc, args.gpu, preset["max_layers"])
        print(f"[bench] {n_layers} layers fit {nproc} x {args.gpu} (dry-run planner)", flush=True)
        overrides += ["--model.n_layers", str(n_layers)]
    common = [*overrides, *bench_common.measuring(args.steps), "--fresh"]
    results = []
    with bench_common.work_dir(args.work_dir, "bench_train_") as work:
        for name in variants:
            command = run_variant(name, config, common, nproc, work, args.timeout)
            results.append(summarize(name, command, measured_steps(work / name, args.warmup)))

    from train.build import resolve_param_dtype
    from train.config import load_config

    run = load_config(REPO / config, overrides)
    name = args.name or f"train_{args.preset or Path(config).stem}"
    report = {
        **bench_common.report_head(name, "bench_train.py", raw_argv),
        "config": config,
        "overrides": overrides,
        "nproc": nproc,
        "steps": args.steps,
        "warmup": args.warmup,
        "fp8_peak_over_bf16": FP8_PEAK_OVER_BF16,
        # "bf16" names the variant without FP8; on CPU its params are fp32 (probe blocker 8)
        "baseline_param_dtype": resolve_param_dtype(run.training.param_dtype),
        "results": results,
    }
    bench_common.write_report(args.out / name, report, to_markdown(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="run config TOML (default: the preset's)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named GPU target")
    parser.add_argument("--data", type=Path, required=True, help="prepared DATA dir")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs or 1)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--gpu", default="h100", help="preset: GPU kind the layer count fits")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench")
    parser.add_argument("--name", help="output file stem (default train_<preset|config>)")
    parser.add_argument("--work-dir", type=Path, help="run folders (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per variant")
    return bench_common.cli(parser, bench, argv)


if __name__ == "__main__":
    sys.exit(main())
