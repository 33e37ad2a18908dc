"""lm-evaluation-harness hooks for the task YAML files beside this one (`!function hooks.X`).

Why a custom loader instead of `dataset_path: json` with `data_files`: lm-eval hands
`data_files` to `datasets.load_dataset`, which resolves a relative path against the current
folder, so shipped YAML could only name the task files by absolute path. This loader finds
them beside the package (eval/tasks/) from any folder, reads them with our own parser
(eval.tasks.load_tasks: the same checks as for `--tasks` files) and builds the
`datasets` table in memory: no `datasets` cache written, nothing fetched.

Scoring of the generation kinds is ours (eval.tasks.generation_ok), the one definition of
what a generation scores for `exact_match` and `contains`. A completion's
reference is scored per byte (lm-eval's `bits_per_byte` aggregation), a number that, unlike
lm-eval's per-example perplexity of a summed log-likelihood, stays finite on long references.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from eval.tasks import generation_ok, load_tasks

TASK_FILES = Path(__file__).resolve().parents[1] / "tasks"


def load_docs(task_file: str, **_task_metadata):
    """`custom_dataset`: lm-eval calls it with the YAML's `dataset_kwargs` and its
    `metadata` (the task version), and reads the `test` split."""
    import datasets

    rows = [
        {k: v for k, v in asdict(t).items() if k != "max_tokens"}  # the YAML holds max_tokens
        for t in load_tasks(TASK_FILES / task_file)
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def score_generation(doc: dict, results: list[str]) -> dict[str, float]:
    """`process_results` for exact_match / contains: results holds the one generation."""
    return {"accuracy": float(generation_ok(doc["kind"], results[0], doc["target"]))}


def score_reference(doc: dict, results: list[tuple[float, bool]]) -> dict:
    """`process_results` for completion: lm-eval scored the reference together with the
    prompt's trailing whitespace, which it moves into the continuation
    (TemplateLM._encode_pair), so the bytes are those of both."""
    loglikelihood, is_greedy = results[0]
    prompt = doc["prompt"]
    scored = prompt[len(prompt.rstrip()) :] + doc["reference"]
    return {"bits_per_byte": (loglikelihood, len(scored.encode())), "acc": int(is_greedy)}
