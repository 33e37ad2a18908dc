"""Plot a run's curves as PNGs next to it: `python scripts/plot_run.py RUN`.

People judge a run by looking at it: is the loss still falling, does validation follow
training, do the eval scores climb with the checkpoints? TensorBoard answers that when it
is running; these PNGs answer it in a terminal session, a CI artifact or a chat message.

Reads what the other stages already wrote (nothing is recomputed):
- `RUN/metrics.jsonl` (train/): one line per logged step, `loss` and, on validation steps,
  `val_loss`. A resumed run may log a step twice (the steps after the last checkpoint are
  redone); the last record of a step wins, as it is the one the final weights came from.
- `RUN/eval/step-N/summary.json` (eval/): each task's scores from the engine that scored
  it (`scores_by_task`: lm-eval's `lm_eval.tasks`, our runner's `scores`) and the `heldout`
  loss at step N.

Writes `RUN/plots/loss.png` and, when evals exist, `RUN/plots/eval.png`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on training nodes or CI
import matplotlib.pyplot as plt  # noqa: E402

from common import run_layout  # noqa: E402
from common.io import ArgumentParser, run_cli  # noqa: E402


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """Last record per step from RUN/metrics.jsonl."""
    records, num_torn = run_layout.read_metrics(run_dir)
    by_step: dict[int, dict] = {}
    for record in records:
        by_step.setdefault(int(record["step"]), {}).update(record)
    if num_torn:
        path = run_dir / run_layout.METRICS
        print(f"{path}: skipped {num_torn} torn line(s) (a killed run)", file=sys.stderr)
    return dict(sorted(by_step.items()))


def read_eval_summaries(run_dir: Path) -> dict[int, dict]:
    paths = sorted((run_dir / run_layout.EVAL_DIR).glob("step-*/summary.json"))
    summaries = {int(s["step"]): s for s in (json.loads(p.read_text()) for p in paths)}
    return dict(sorted(summaries.items()))


def plot_loss(metrics: dict[int, dict], out: Path, unigram_entropy: float | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    if unigram_entropy is not None:
        ax.axhline(unigram_entropy, color="grey", ls="--", lw=1, label="unigram entropy")
    train = [(s, r["loss"]) for s, r in metrics.items() if r.get("loss") is not None]
    val = [(s, r["val_loss"]) for s, r in metrics.items() if r.get("val_loss") is not None]
    ax.plot(*zip(*train, strict=True), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", lw=1.5)
    ax.set(
        xlabel="step", ylabel="cross-entropy (nats/token)", title=f"{out.parent.parent.name}: loss"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def scores_by_task(summary: dict) -> dict[str, dict]:
    """Each task's scores in an eval summary: lm-eval's `lm_eval.tasks` (its standard
    errors left out), and the `scores` of a summary written before lm-eval scored every
    task (docs/eval.md, "Which engine scores what")."""
    scores = dict(summary.get("scores") or {})
    for task, row in ((summary.get("lm_eval") or {}).get("tasks") or {}).items():
        scores[task] = {k: v for k, v in row.items() if "_stderr" not in k and v is not None}
    return scores


def plot_evals(summaries: dict[int, dict], out: Path) -> Path:
    steps = list(summaries)
    scores = {s: scores_by_task(summaries[s]) for s in steps}
    tasks = sorted({t for s in steps for t in scores[s]})
    fig, (ax_scores, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4))
    for task in tasks:
        # our runner's accuracy and word match; lm-eval's accuracy (ours, through its
        # hooks) and acc (multiple choice, and a completion's greedy match)
        for metric in ("accuracy", "acc", "prefix_word_match"):
            points = [
                (s, scores[s][task][metric]) for s in steps if metric in scores[s].get(task, {})
            ]
            if points:
                ax_scores.plot(*zip(*points, strict=True), "o-", label=f"{task} {metric}")
    ax_scores.set(xlabel="checkpoint step", ylabel="score", title="eval scores (through vLLM)")
    ax_scores.grid(alpha=0.3)
    ax_scores.legend(fontsize=8)
    ppl = [(s, math.exp(summaries[s]["heldout"]["loss"])) for s in steps if summaries[s]["heldout"]]
    if ppl:
        ax_ppl.plot(*zip(*ppl, strict=True), "o-", color="C3")
    ax_ppl.set(xlabel="checkpoint step", ylabel="held-out perplexity")
    ax_ppl.set_title("held-out perplexity (through vLLM)")
    ax_ppl.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_run(run_dir: Path, unigram_entropy: float | None = None) -> list[Path]:
    """unigram_entropy: drawn as the line a model that learned context must go below."""
    metrics = metrics_by_step(run_dir)  # a folder that is no run is refused, not given plots/
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_loss(metrics, out_dir / "loss.png", unigram_entropy)]
    summaries = read_eval_summaries(run_dir)
    if summaries:
        written.append(plot_evals(summaries, out_dir / "eval.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="training run folder (holds metrics.jsonl)")
    args = parser.parse_args(argv)

    def body() -> None:
        for path in plot_run(args.run):
            print(path)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
