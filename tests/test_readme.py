"""Every command the README shows is run by a test, so the README cannot go stale.

The README's ```bash blocks are parsed into commands. Each command is either cheap enough
to run here exactly as written (`RUN_AS_WRITTEN`), or it is mirrored by a named test that
runs the same entry point with the same flags on smaller inputs (`MIRRORED_BY`): every
`--flag` of the README command must appear in that test function (or in the helpers of its
file it calls), unless the command also runs verbatim. A README command that matches neither fails the suite: add the test before
adding the command.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.utils.noise import noise_lines

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"

# command prefix -> the test that runs it (file::function)
MIRRORED_BY = {
    "scripts/quickstart.sh": "tests/test_quickstart.py::test_quickstart_end_to_end",
    "scripts/test.sh": "tests/test_readme.py::test_ci_runs_the_readme_test_command",
    ".venv/bin/python -m dataloader.prepare --input corpus/*.jsonl.gz": (
        "tests/dataloader/prepare/test_prepare.py::test_readme_jsonl_gz_command"
    ),
    "scripts/train_local.sh": "tests/scripts/test_launchers.py::test_train_local_trains_debug_config_on_two_cpu_processes",
    "scripts/slurm/submit.py": (
        "tests/scripts/test_slurm_multinode.py::test_two_node_job_trains_across_namespaces"
    ),
    "scripts/slurm/submit_prepare.py": (
        "tests/scripts/test_slurm_prepare.py::"
        "test_array_prepare_survives_a_killed_task_and_matches_single_process"
    ),
    ".venv/bin/python -m eval.export": (
        "tests/test_quickstart.py::test_quickstart_end_to_end via scripts/quickstart.py"
    ),
    "scripts/serve.sh": (
        "tests/eval/test_serve_cli.py::test_serve_sh_serves_on_loopback_and_stops_cleanly_on_sigterm"
    ),
    ".venv/bin/python -m eval --server": "tests/eval/test_serve_eval.py::test_eval_end_to_end",
    ".venv/bin/python -m eval.watch": "tests/eval/test_watch.py::test_watch_once_then_restart",
    ".venv/bin/python -m train.ledger": (
        "tests/train/ledger/test_ledger_chaos.py::test_readme_ledger_commands"
    ),
    ".venv/bin/python -m train --config configs/llama3_8b_fp8.toml --dry-run --suggest": (
        "tests/train/plan/test_plan_suggest.py::"
        "test_suggest_ranks_admitted_layouts_and_agrees_with_the_full_plan"
    ),
    ".venv/bin/python -m train.forensics": (
        "tests/train/forensics/test_forensics.py::"
        "test_forensics_names_the_poisoned_documents_and_replays_the_spike"
    ),
}

# commands cheap enough to run verbatim here (cwd: a scratch folder, so nothing in the
# checkout is touched), with what a pass looks like
RUN_AS_WRITTEN = {
    ".venv/bin/python -m dataloader.prepare --input shakespeare": "data/shakespeare/train",
    ".venv/bin/python -m train --config configs/llama3_70b_fp8.toml --dry-run": "70.55B",
    "scripts/slurm/submit.py": "sbatch",  # with --dry-print: prints the sbatch command
}


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(" ".join(command.split()))
    return commands


def _matches(command: str, table: dict) -> list[str]:
    return [prefix for prefix in table if command.startswith(prefix)]


def test_readme_has_the_two_commands():
    commands = readme_commands()
    assert commands[:2] == ["scripts/quickstart.sh", "scripts/test.sh"]


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_is_covered(command):
    mirrors = _matches(command, MIRRORED_BY)
    assert mirrors or _matches(command, RUN_AS_WRITTEN), (
        f"README command {command!r} is run by no test: add one to MIRRORED_BY or RUN_AS_WRITTEN"
    )
    if _matches(command, RUN_AS_WRITTEN):
        return  # run verbatim below: every flag is exercised
    for prefix in mirrors:
        body = _test_source(MIRRORED_BY[prefix])
        missing = [f for f in re.findall(r"(?<![\w-])--[\w.-]+", command) if f not in body]
        assert not missing, (
            f"{MIRRORED_BY[prefix]} mirrors README command {command!r} but never passes {missing}"
        )


def _test_source(where: str) -> str:
    """The source of a test function plus the module-level helpers it calls, plus the script
    it runs when the entry says `... via scripts/X.py` (the test runs that script, which runs
    the command)."""
    where, _, via = where.partition(" via ")
    path, func = where.split("::")
    source = (ROOT / path).read_text()
    match = re.search(rf"^(async )?def {func}\(.*?(?=^[^\s)])", source + "\nEND", re.M | re.S)
    assert match, f"{where} does not exist"
    body = match.group(0)
    helpers = set(re.findall(r"\b(_?\w+)\(", body))
    for name in helpers:
        helper = re.search(rf"^def {name}\(.*?(?=^[^\s)])", source + "\nEND", re.M | re.S)
        if helper:
            body += helper.group(0)
    if via:
        body += (ROOT / via).read_text()
    return body


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci


@pytest.mark.parametrize(
    "command", [c for c in readme_commands() if _matches(c, RUN_AS_WRITTEN)], ids=str
)
def test_cheap_readme_command_runs_as_written(command, tmp_path):
    (expected,) = {RUN_AS_WRITTEN[p] for p in _matches(command, RUN_AS_WRITTEN)}
    argv = shlex.split(command)
    if argv[0].startswith("scripts/"):
        argv[0] = str(ROOT / argv[0])
    if argv[0] == ".venv/bin/python":
        argv[0] = str(VENV_PYTHON)
    if "scripts/slurm/submit.py" in command:
        argv.append("--dry-print")
    # configs/ paths are the repo's; everything the command writes goes to tmp_path
    argv = [str(ROOT / a) if a.startswith("configs/") else a for a in argv]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if expected.startswith("data/"):
        assert (tmp_path / expected / "manifest.json").exists()
        # the quickstart's prepare stage on a fresh machine (tests/test_quickstart.py reuses
        # the session's data): our lines only, no library import-time noise
        assert noise_lines(proc.stdout + proc.stderr) == []
    else:
        assert expected in proc.stdout, proc.stdout[-3000:]
