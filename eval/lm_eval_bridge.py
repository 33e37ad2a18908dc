"""lm-evaluation-harness through the served export: `python -m eval [--lm-eval TASKS]`.

Why lm-eval, and why it is the engine of every task (the shipped Shakespeare tasks by
default, `--tasks` files too; our runner keeps the held-out loss, docs/eval.md): it
is what pretraining teams report, so a checkpoint's scores on its standard tasks (ARC,
HellaSwag, ...) compare with published numbers, which our Shakespeare tasks never will. Why
through the server and not in-process: the served export is what users get; scoring it
through vLLM checks export and serving together, as the held-out loss does, and needs no second
copy of the weights in this process.

How it talks to the server: lm-eval's `local-completions` model (its OpenAI-completions
client, lm_eval/models/openai_completions.py on top of api_models.TemplateAPI) posts to the
server's `/v1/completions`. Generation tasks send greedy requests that stop at EOS (and at
the task's `until` strings); log-likelihood tasks send context + continuation with `echo`,
`logprobs=1` and `max_tokens=1`, and sum the echoed log-probabilities of the continuation.
Both are sent as token ids, which lm-eval computes itself, so it needs the tokenizer:

- The tokenizer is the served folder's own files (`tokenizer_backend=huggingface`,
  `tokenizer=<folder>`), never a hub name: lm-eval would otherwise look the model id up on
  the hub. A server whose folder is not on this machine is refused in one line.
- BOS: our tokenizer's post-processor prepends one BOS (dataloader/tokenizer.py), as every
  training document starts. lm-eval adds special tokens only with `add_bos_token=True`,
  which the bridge sets, and checks first that the tokenizer adds exactly one BOS: without
  it every request would lack the BOS the model was trained with.
- `max_length` is the served `max_model_len` (lm-eval's default, 2048, would silently cut a
  longer served context, or overrun a shorter one).

No hub at run time: `HF_HUB_OFFLINE=1` and `HF_DATASETS_OFFLINE=1` are set before lm-eval,
`datasets` or `huggingface_hub` are imported (`go_offline`, which the CLIs reach first thing
through `lm_eval_kwargs`), so a task whose data is not on disk fails instead of
downloading. The shipped tasks are YAML over the local task files (eval/lm_eval_tasks/,
written by scripts/make_tasks.py); lm-eval's standard tasks run from a local `datasets`
cache (docs/eval.md says how).

Which index: lm-eval's own index of ~15,000 task YAMLs takes ~11 s to build on 2 cores, so
the bridge first indexes only our folder and `--lm-eval-include` folders, and adds lm-eval's
own only when a requested name is not among them. An unknown name is one line before any
request is sent.

Results: per task and metric in the eval summary (`lm_eval.tasks`), as TensorBoard scalars
`eval/lm_eval/TASK/METRIC` beside ours, and per example in `lm_eval_samples.jsonl`
(lm-eval's own sample records: the request arguments, the raw and filtered responses).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from common.io import write_jsonl_atomic
from eval.tasks import builtin_task_files, load_tasks

TASK_DIR = Path(__file__).parent / "lm_eval_tasks"
SAMPLES_FILE = "lm_eval_samples.jsonl"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
MODEL = "local-completions"
# lm-eval bootstraps the standard errors of some standard tasks' metrics (perplexity, f1,
# bleu, ...; a mean's is closed-form); its CLI default is 100,000 resamples in a pool of
# cpu_count() processes. 1,000 serial ones (DISABLE_MULTIPROC) estimate the error to ~2%
# (1/sqrt(2 x 1000)) without forking a pool beside a vLLM server.
BOOTSTRAP_ITERS = 1000
NOT_INSTALLED = (
    "--lm-eval needs lm-evaluation-harness, which is not installed: install the project's "
    "`lm-eval` extra (scripts/setup.sh does; or pip install -e '.[lm-eval]'); it scores the "
    "shipped tasks by default, so without it pass --lm-eval none (the held-out loss and "
    "--tasks files only)"
)
NO_LM_EVAL = "none"  # `--lm-eval none`: no lm-eval, not even the shipped tasks


def add_lm_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The lm-evaluation-harness flags of `python -m eval` and `python -m eval.watch`."""
    group = parser.add_argument_group("lm-evaluation-harness (the optional `lm-eval` extra)")
    group.add_argument(
        "--tasks",
        nargs="+",
        type=Path,
        default=[],
        help="JSONL task files in our format (eval/tasks.py), scored by lm-eval as tasks "
        "named by the files, beside --lm-eval's",
    )
    group.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="comma-separated lm-eval tasks, groups or tags run through the server: the "
        "shipped shakespeare (or shakespeare_markup, ...), or lm-eval's own from a local "
        "datasets cache (docs/eval.md); nothing is fetched from the hub. Default: the "
        "shipped tasks not given to --tasks (each task one engine); none: no lm-eval",
    )
    group.add_argument(
        "--lm-eval-include",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of your own lm-eval task YAML (repeatable)",
    )
    group.add_argument("--lm-eval-limit", type=int, metavar="N", help="examples per task")


def lm_eval_kwargs(args: argparse.Namespace) -> dict:
    """`add_lm_eval_arguments`' values as EvalConfig keyword arguments: the task names
    lm-eval runs (without `--lm-eval`, the shipped tasks: each eval/tasks/*.jsonl file is
    the lm-eval task of the same name, eval/lm_eval_tasks/), then those of the `--tasks`
    files, each task once (None: no task), and the files. When lm-eval will run, the
    process goes offline (`go_offline`) first, before anything imports the hub's code."""
    if args.lm_eval is None:
        tasks = [f.stem for f in builtin_task_files()]
    elif args.lm_eval.strip() == NO_LM_EVAL:
        tasks = []
    else:
        tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
    tasks = list(dict.fromkeys([*tasks, *(Path(f).stem for f in args.tasks)]))
    if tasks:
        go_offline()
    return {
        "task_files": args.tasks,
        "lm_eval_tasks": tasks or None,
        "lm_eval_include": args.lm_eval_include,
        "lm_eval_limit": args.lm_eval_limit,
    }


def go_offline() -> None:
    """Keep lm-eval, `datasets` and `huggingface_hub` off the hub. Their offline switches
    are read once, when each is imported, so this must run before any of them is: the
    CLIs call it first thing when lm-eval will run."""
    os.environ.update(OFFLINE_ENV)
    hub = sys.modules.get("huggingface_hub.constants")
    data = sys.modules.get("datasets.config")
    if (hub is not None and not hub.HF_HUB_OFFLINE) or (
        data is not None and not data.HF_DATASETS_OFFLINE
    ):
        raise ValueError(
            "huggingface_hub or datasets was imported before HF_HUB_OFFLINE / "
            "HF_DATASETS_OFFLINE were set, so lm-eval could reach the hub: set both to 1 in "
            "the environment (or call eval.lm_eval_bridge.go_offline() first)"
        )


@dataclass
class LmEvalPlan:
    """What `--lm-eval` and `--tasks` will run, checked before any request: the task
    names, the task index that knows them, and the optional example limit per task."""

    tasks: list[str]
    limit: int | None = None
    task_manager: Any = None

    @classmethod
    def prepare(
        cls,
        tasks: list[str],
        include: list[Path],
        limit: int | None,
        task_files: list[Path] = (),
        folder: Path | None = None,
    ) -> LmEvalPlan:
        """`task_files`: `--tasks` files, each written as an lm-eval task into `folder`
        (its YAML, which includes its kind's base YAML in TASK_DIR), unless it is a shipped
        one."""
        if importlib.util.find_spec("lm_eval") is None:  # the optional extra: before any work
            raise ValueError(NOT_INSTALLED)
        go_offline()
        if not tasks:
            raise ValueError("--lm-eval: no task names (comma-separated, e.g. shakespeare)")
        if limit is not None and limit < 1:
            raise ValueError(f"--lm-eval-limit {limit}: must be at least 1")
        for include_dir in include:
            if not Path(include_dir).is_dir():
                raise ValueError(f"--lm-eval-include {include_dir}: no such folder of task YAMLs")
        paths = [str(TASK_DIR), *map(str, include)]
        own = own_task_yamls(task_files, folder)
        if own is not None:
            paths.append(str(own))
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=paths, include_defaults=False)
        if any(not _known(manager, name) for name in tasks):
            manager = TaskManager(include_path=paths, include_defaults=True)  # lm-eval's own
        unknown = [name for name in tasks if not _known(manager, name)]
        if unknown:
            ours = sorted(n for n in manager.all_tasks if n.startswith("shakespeare"))
            raise ValueError(
                f"--lm-eval {','.join(unknown)}: no such lm-eval task, group or tag (shipped: "
                f"{', '.join(ours)}; lm-eval's own by name, e.g. arc_easy, with their data in "
                "the local datasets cache; your own YAML folder with --lm-eval-include)"
            )
        return cls(tasks=list(tasks), limit=limit, task_manager=manager)


def own_task_yamls(task_files: list[Path], folder: Path | None) -> Path | None:
    """The lm-eval task of each `--tasks` file that is not a shipped one, written into
    `folder` (None: there is none). Its name is the file's stem, so a file named like a
    shipped task is refused: two tasks of one name would shadow each other."""
    shipped = {f.stem: f.resolve() for f in builtin_task_files()}
    own = [Path(f) for f in task_files if shipped.get(Path(f).stem) != Path(f).resolve()]
    for path in own:
        load_tasks(path)  # a malformed line: its file:line before anything else
        if path.stem in shipped:
            raise ValueError(
                f"--tasks {path}: named like the shipped task {path.stem}; rename the file"
            )
    if not own:
        return None
    assert folder is not None, "--tasks files need a folder for their lm-eval tasks"
    folder.mkdir(parents=True, exist_ok=True)
    for path in own:
        yaml = task_yaml(path, "own_tasks", source=str(path.resolve()))
        (folder / f"{path.stem}.yaml").write_text(yaml)
    return folder


def _known(manager, name: str) -> bool:
    return name in manager.all_tasks or (name.endswith(".yaml") and Path(name).is_file())


def check_tokenizer(folder: Path) -> None:
    """lm-eval tokenizes the requests itself with the served folder's tokenizer: it must be
    on this machine and prepend exactly one BOS (the model's training format)."""
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"--lm-eval needs the served model's tokenizer on this machine, and {folder} holds "
            "none (is the server running elsewhere?): run the eval where the export is"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer("x", add_special_tokens=True).input_ids
    bos = tokenizer.bos_token_id
    if bos is None or ids[:1] != [bos] or ids[1:2] == [bos]:
        raise ValueError(
            f"{folder}: its tokenizer does not prepend one BOS (encodes 'x' as {ids}); "
            "lm-eval's requests would miss the BOS every training document starts with: "
            "re-export with python -m eval.export (it writes the project's tokenizer)"
        )


def model_args(
    server: str, model_id: str, tokenizer: Path, max_length: int, concurrency: int, timeout_s
) -> dict[str, Any]:
    """`local-completions` arguments (lm_eval/models/api_models.py TemplateAPI)."""
    return {
        "base_url": server.rstrip("/") + "/v1/completions",
        "model": model_id,
        "tokenizer": str(tokenizer),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "add_bos_token": True,
        "max_length": max_length,
        "num_concurrent": concurrency,
        "max_retries": 3,
        "timeout": int(timeout_s),
    }


def run(plan: LmEvalPlan, args: dict[str, Any], api_key: str | None, out: Path) -> dict[str, Any]:
    """Run the plan's tasks against the server (`args`: `model_args`', the tokenizer checked
    already); the summary entry, with the records written to `out/lm_eval_samples.jsonl`."""
    import lm_eval

    started = time.perf_counter()
    # local-completions sends OPENAI_API_KEY as its bearer token; set only for the run (not
    # in model_args, which lm-eval logs and returns): patch.dict restores the environment
    env = {"DISABLE_MULTIPROC": "1"} | ({"OPENAI_API_KEY": api_key} if api_key else {})
    with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(sys.stderr):  # stdout: JSON
        results = lm_eval.simple_evaluate(
            model=MODEL,
            model_args=args,
            tasks=plan.tasks,
            task_manager=plan.task_manager,
            limit=plan.limit,
            log_samples=True,
            bootstrap_iters=BOOTSTRAP_ITERS,
        )
    seconds = time.perf_counter() - started
    samples = [
        {"task": task, **record}
        for task, records in (results.get("samples") or {}).items()
        for record in records
    ]
    write_jsonl_atomic(out / SAMPLES_FILE, json.loads(json.dumps(samples, default=str)))
    return {
        "version": lm_eval.__version__,
        "model": MODEL,
        "model_args": args,
        "requested": plan.tasks,
        "limit": plan.limit,
        "tasks": task_scores(results),
        "seconds": seconds,
        "samples_file": SAMPLES_FILE,
    }


def task_scores(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{task: {metric: value, metric_stderr: value, num_examples: n}} from lm-eval's
    results; lm-eval's "METRIC,FILTER" keys keep the filter unless it is "none"."""
    counts = results.get("n-samples") or {}
    scores: dict[str, dict[str, Any]] = {}
    for task, entry in results["results"].items():
        row: dict[str, Any] = {}
        for key, value in entry.items():
            if key == "alias" or "," not in key:
                continue
            metric, _, flt = key.partition(",")
            name = metric if flt == "none" else f"{metric},{flt}"
            row[name] = value if isinstance(value, (int, float)) else None
        if task in counts:
            row["num_examples"] = counts[task].get("effective")
        scores[task] = row
    return scores


def tensorboard_scalars(lm_eval_summary: dict[str, Any]) -> dict[str, float]:
    """`eval/lm_eval/TASK/METRIC` -> value, beside our `eval/...` scalars; no standard
    errors or counts."""
    scalars = {}
    for task, row in lm_eval_summary["tasks"].items():
        for name, value in row.items():
            if name == "num_examples" or "_stderr" in name or not isinstance(value, float | int):
                continue
            scalars[f"eval/lm_eval/{task}/{name.replace(',', '/')}"] = float(value)
    return scalars


# Our task kinds as lm-eval tasks: each task YAML includes its kind's base YAML in TASK_DIR
# (the why of each setting is there); a generation task adds its generation_kwargs.
_KIND_BASE = {
    "exact_match": "_generation.yaml",
    "contains": "_generation.yaml",
    "multiple_choice": "_multiple_choice.yaml",
    "completion": "_completion.yaml",
}
_GENERATION = """generation_kwargs:
  until: []
  max_gen_toks: {max_tokens}
  do_sample: false
  temperature: 0.0
"""


def task_yaml(task_file: Path, tag: str, source: str | None = None) -> str:
    """The lm-eval task YAML for one of our JSONL task files (one kind per file), named by
    the file and loading it through hooks.load_docs: scripts/make_tasks.py writes these
    for the shipped files (found beside the hooks, eval/tasks/), `own_task_yamls` for
    `--tasks` files (`source`: the file's absolute path)."""
    tasks = load_tasks(task_file)
    kinds = {t.kind for t in tasks}
    max_tokens = {t.max_tokens for t in tasks}
    if len(kinds) != 1 or len(max_tokens) != 1:
        raise ValueError(
            f"{task_file}: an lm-eval task needs one kind and one max_tokens per file "
            f"(found kinds {sorted(kinds)}, max_tokens {sorted(max_tokens)})"
        )
    base = _KIND_BASE[kinds.pop()]
    generation = _GENERATION.replace("{max_tokens}", str(max_tokens.pop()))
    return (
        f"# Written by {'python -m eval' if source else 'scripts/make_tasks.py'} from "
        f"{source or 'eval/tasks/' + task_file.name}; do not edit.\n"
        f"include: {json.dumps(str(TASK_DIR / base)) if source else base}\n"
        f"tag: {tag}\n"
        f"task: {task_file.stem}\n"
        "dataset_kwargs:\n"
        f"  task_file: {json.dumps(source) if source else task_file.name}\n"
        f"{generation if base == '_generation.yaml' else ''}"
    )
