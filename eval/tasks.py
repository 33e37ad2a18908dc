"""Task files: JSONL, one example per line, four kinds.

Why these four: together they cover what a small pretrained (not instruction-tuned) model
can be asked through a completions endpoint. Greedy generation checks decoding end to end
(`exact_match`, `contains`); log-likelihood ranking (`multiple_choice`, scored with
`echo` + `logprobs` on /v1/completions) gives a graded signal long before generations are
right; `completion` scores a held-out continuation's per-token log-likelihood.

    {"id": "hamlet-1", "kind": "exact_match", "prompt": "To be, or not to", "target": " be"}
    {"id": "...", "kind": "contains", "prompt": "...", "target": "Romeo", "max_tokens": 16}
    {"id": "...", "kind": "multiple_choice", "prompt": "...", "choices": [" be", " go"], "answer": 0}
    {"id": "...", "kind": "completion", "prompt": "...", "reference": "..."}

A malformed line is a `ValueError` naming the file and the line number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("exact_match", "contains", "multiple_choice", "completion")
_REQUIRED = {
    "exact_match": ("prompt", "target"),
    "contains": ("prompt", "target"),
    "multiple_choice": ("prompt", "choices", "answer"),
    "completion": ("prompt", "reference"),
}
_OPTIONAL = {"id", "kind", "max_tokens"}


@dataclass
class Task:
    id: str
    kind: str
    prompt: str
    target: str = ""
    choices: list[str] = field(default_factory=list)
    answer: int = -1
    reference: str = ""
    max_tokens: int = 16


def load_tasks(path: Path | str) -> list[Task]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such task file")
    tasks, seen = [], set()
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        kind = raw.get("kind")
        if kind not in KINDS:
            raise ValueError(f"{where}: 'kind' is {kind!r}; use one of {', '.join(KINDS)}")
        missing = [k for k in _REQUIRED[kind] if k not in raw]
        if missing:
            raise ValueError(f"{where}: a {kind} task needs {', '.join(missing)}")
        unknown = set(raw) - _OPTIONAL - set(_REQUIRED[kind])
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} for a {kind} task")
        for key in ("prompt", "target", "reference"):
            if key in raw and not (isinstance(raw[key], str) and raw[key]):
                raise ValueError(f"{where}: '{key}' must be a non-empty string")
        if kind == "multiple_choice":
            choices, answer = raw["choices"], raw["answer"]
            if not (
                isinstance(choices, list)
                and len(choices) >= 2
                and all(isinstance(c, str) and c for c in choices)
            ):
                raise ValueError(f"{where}: 'choices' must be a list of 2+ non-empty strings")
            if not (isinstance(answer, int) and 0 <= answer < len(choices)):
                raise ValueError(
                    f"{where}: 'answer' must be an index into choices (0..{len(choices) - 1})"
                )
        max_tokens = raw.get("max_tokens", 16)
        if not (isinstance(max_tokens, int) and max_tokens > 0):
            raise ValueError(f"{where}: 'max_tokens' must be a positive integer")
        task_id = str(raw.get("id", f"{path.stem}-{line_no}"))
        if task_id in seen:
            raise ValueError(f"{where}: duplicate id {task_id!r}")
        seen.add(task_id)
        tasks.append(Task(**raw | {"id": task_id}))  # its keys are Task's, checked above
    if not tasks:
        raise ValueError(f"{path}: no tasks (empty file)")
    return tasks


def generation_ok(kind: str, generation: str, target: str) -> bool:
    """Whether a greedy generation scores for its task: `exact_match` if it starts with the
    target, `contains` if it holds the target anywhere: the lm-evaluation-harness tasks'
    scoring over these files (eval/lm_eval_tasks/hooks.py)."""
    if kind == "exact_match":
        return generation.startswith(target)
    if kind == "contains":
        return target in generation
    raise ValueError(f"{kind!r} is not a generation kind with a target (exact_match, contains)")


def builtin_task_files() -> list[Path]:
    return sorted((Path(__file__).parent / "tasks").glob("*.jsonl"))
