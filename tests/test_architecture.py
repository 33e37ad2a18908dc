"""The package map in docs/architecture.md, enforced.

Imports flow one way: common <- dataloader <- train <- eval <- scripts. `common` (the
shared helpers) imports nothing of ours and only the standard library; `dataloader` imports
only `common`; `train` may
import `dataloader`; `eval` may import `dataloader` and only the documented contract of
`train` (docs/contracts.md); `scripts` and `tests` may import anything. A new edge is a
deliberate change: update docs/architecture.md and the table below together.

Rooms stay small: no module of `common`, `dataloader`, `train` or `eval` is over
`MAX_MODULE_LINES`. A file past it has grown a second job; split it by job (as
`train/ledger/` is: recorder, checks, replay, readers, command), not by line count.

Wings, not prefixes: `train/` keeps the front door and the run itself (at most
`MAX_TRAIN_MODULES` modules); the rest lives in sub-packages named by their job
(`train/plan/`, `train/reliability/`, `train/components/`, `train/compat/`,
`train/ledger/`, `train/forensics/`, `train/config/`; `dataloader/prepare/`), each with a
docstring saying that job. Between wings: only the front door (train/__main__.py), the
forensics replay's own plan (train/forensics/plan.py) and the launch's memory check
(train/preflight.py, the planner's GPU rows) import the planner; `train/reliability/` imports neither the planner nor the components; no room
imports an entry point (`__main__`); only `train/config/` parses TOML (a run config is read
through `train.config`, never by hand: the ledger's verifier once kept its own copy of the
defaults); and `python -m train.ledger` imports no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("common", "dataloader", "train", "eval", "scripts")

# package -> the packages of ours it may import. The data ledger's verifier is train's
# (train/ledger/: it reads RUN/config.toml through train.config, and imports dataloader for
# the loader's own order); dataloader keeps only the record format its loader writes
# (dataloader/ledger_record.py), never a reader of a run config.
ALLOWED = {
    "common": {"common"},
    "dataloader": {"common", "dataloader"},
    "train": {"common", "dataloader", "train"},
    "eval": {"common", "dataloader", "eval", "train"},
}
# the names of `train` that eval may use: docs/contracts.md, section 3
TRAIN_CONTRACT_FOR_EVAL = {
    "train.config": {"load_config"},
    "train.model": {"build_model_spec"},
}


def imports_of(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every import in a file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [a.name for a in node.names], node.lineno))
    return found


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        where = path.relative_to(REPO)
        for module, names, line in imports_of(path):
            top = module.split(".")[0]
            if top not in OURS:
                continue
            if top not in ALLOWED[package]:
                bad.append(f"{where}:{line}: {package} may not import {module}")
            elif package == "eval" and top == "train":
                allowed = TRAIN_CONTRACT_FOR_EVAL.get(module, set())
                extra = sorted(set(names or ["*"]) - allowed)
                if extra:
                    bad.append(
                        f"{where}:{line}: eval imports {module}.{extra} outside the train "
                        "contract (docs/contracts.md)"
                    )
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_flow_one_way(package):
    assert violations(package) == []


def non_stdlib_imports(package: str) -> list[str]:
    """Imports of a package that are neither the standard library nor the package itself."""
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for module, _, line in imports_of(path):
            top = module.split(".")[0]
            if top != package and top not in sys.stdlib_module_names and top != "__future__":
                bad.append(f"{path.relative_to(REPO)}:{line}: {module}")
    return bad


def test_common_imports_only_the_standard_library():
    """The bottom floor stays light: every command's --help and every worker imports it."""
    assert non_stdlib_imports("common") == []


def test_the_stdlib_check_sees_a_library(tmp_path, monkeypatch):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "x.py").write_text("import os\n\ndef f():\n    import numpy\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert non_stdlib_imports("common") == ["common/x.py:4: numpy"]


def test_the_checker_sees_a_wrong_edge(tmp_path, monkeypatch):
    # the rule is only as good as the parser: a nested import of eval from dataloader counts
    fake = tmp_path / "dataloader"
    fake.mkdir()
    (fake / "x.py").write_text("def f():\n    from eval.serve import VLLMServer\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert violations("dataloader") == ["dataloader/x.py:2: dataloader may not import eval.serve"]


def conftest_imports(root: Path) -> list[str]:
    """Imports of a conftest module by any file under `root`, nested imports included."""
    return [
        f"{path.relative_to(root.parent)}:{line}: {module}"
        for path in sorted(root.rglob("*.py"))
        for module, names, line in imports_of(path)
        if module.rsplit(".", 1)[-1] == "conftest" or "conftest" in names
    ]


def test_no_test_imports_a_conftest():
    """conftest files hold fixtures, which pytest hands to the tests that name them; a
    helper a test imports lives in tests/utils (docs/testing.md). Imported, a conftest runs
    its module code a second time under another name (`tests.conftest` beside pytest's
    `conftest`), and two copies of a class then fail `isinstance` against each other."""
    assert conftest_imports(REPO / "tests") == []


def test_the_conftest_check_sees_a_nested_import(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test():\n    from tests import conftest\n")
    assert conftest_imports(tmp_path / "tests") == ["tests/test_x.py:2: tests"]


# ------------------------------------------------------------------ the wings of train/
MAX_TRAIN_MODULES = 14  # the front door and the run itself; everything else is in a wing
PLANNER, COMPONENTS, RELIABILITY = "train.plan", "train.components", "train.reliability"
FRONT_DOOR = "train/__main__.py"
# who may import the planner: the front door (--dry-run), and the forensics replay, which
# plans its own layout before it loads (a launch reads RUN/budgets.json instead), and the
# preflight, whose memory check reads the planner's GPU rows (torch-free)
PLANNER_USERS = (FRONT_DOOR, "train/forensics/plan.py", "train/preflight.py")


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def wing_violations(root: Path = REPO) -> list[str]:
    """Imports that cross a wing's rule (module docstring), nested imports included."""
    bad = []
    for path in sorted((root / "train").rglob("*.py")):
        rel = path.relative_to(root)
        for module, names, line in imports_of(path):
            # `from train import plan` imports the package train.plan
            targets = {module} | {f"{module}.{name}" for name in names}
            planner = any(_under(m, PLANNER) for m in targets)
            if (
                planner
                and not _under(".".join(rel.parts[:2]), PLANNER)
                and rel.as_posix() not in PLANNER_USERS
            ):
                users = ", ".join(PLANNER_USERS)
                bad.append(f"{rel}:{line}: only {users} import the planner ({module})")
            if _under(".".join(rel.parts[:2]), RELIABILITY) and (
                planner or any(_under(m, COMPONENTS) for m in targets)
            ):
                bad.append(
                    f"{rel}:{line}: train/reliability/ imports neither the planner nor the "
                    f"components ({module})"
                )
    for package in ROOMS:
        for path in sorted((root / package).rglob("*.py")):
            for module, _, line in imports_of(path):
                if (
                    module.endswith(".__main__")
                    or module == "tomllib"
                    and not _under(".".join(path.relative_to(root).parts[:2]), "train.config")
                ):
                    bad.append(
                        f"{path.relative_to(root)}:{line}: imports {module}: "
                        + (
                            "an entry point is no room's dependency"
                            if module.endswith(".__main__")
                            else "only train/config/ parses TOML (read a run config with "
                            "train.config.load_config)"
                        )
                    )
    return sorted(bad)


def test_the_wings_keep_their_rules():
    assert wing_violations() == []


def test_the_wing_checker_sees_a_crossing(tmp_path, monkeypatch):
    (tmp_path / "train" / "reliability").mkdir(parents=True)
    (tmp_path / "train" / "ledger").mkdir()
    (tmp_path / "train" / "reliability" / "x.py").write_text(
        "def f():\n    from train.components.checkpoint import C\n"
    )
    (tmp_path / "train" / "runtime.py").write_text("from train import plan\n")
    (tmp_path / "train" / "__main__.py").write_text("from train.plan.dry_run import run_dry\n")
    (tmp_path / "train" / "ledger" / "checks.py").write_text("import tomllib\n")
    assert wing_violations(tmp_path) == [
        "train/ledger/checks.py:1: imports tomllib: only train/config/ parses TOML (read a run "
        "config with train.config.load_config)",
        "train/reliability/x.py:2: train/reliability/ imports neither the planner nor the "
        "components (train.components.checkpoint)",
        "train/runtime.py:1: only train/__main__.py, train/forensics/plan.py, "
        "train/preflight.py import the "
        "planner (train)",
    ]


def test_train_is_the_front_door_and_the_run_and_each_wing_says_its_job():
    modules = sorted(p.name for p in (REPO / "train").glob("*.py"))
    assert len(modules) <= MAX_TRAIN_MODULES, (
        f"train/ has {len(modules)} modules ({', '.join(modules)}): a module that is not the "
        "front door or the run itself belongs in a wing (docs/architecture.md)"
    )
    wings = sorted(
        p.relative_to(REPO) for package in ROOMS for p in (REPO / package).glob("*/__init__.py")
    )
    assert {str(w.parent) for w in wings} >= {
        "train/plan", "train/reliability", "train/components", "train/compat", "train/ledger",
        "train/forensics", "train/config", "dataloader/prepare",
    }  # fmt: skip
    for wing in wings:
        assert ast.get_docstring(ast.parse((REPO / wing).read_text())), (
            f"{wing}: a wing's docstring says its job"
        )
    # a folder of our code in train/ or dataloader/ is a wing (eval/lm_eval_tasks/ is
    # lm-eval's task folder, not a package of ours)
    for folder in (p for package in ("train", "dataloader") for p in (REPO / package).iterdir()):
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
            assert (folder / "__init__.py").is_file(), f"{folder.relative_to(REPO)}: not a package"


def test_the_ledger_verifier_imports_no_torch():
    """An auditor's machine has no torch: the verifier's rooms import none (the command
    run end to end: tests/train/ledger/test_ledger.py)."""
    probe = (
        "import sys, train.ledger.__main__, train.ledger.checks, train.ledger.replay, "
        "train.ledger.readers; print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "NO-TORCH"


# Every argparse command: `python -m MODULE` or `python scripts/X.py`. Not here, because their
# own job needs torch before parsing anything: eval.export (a DCP -> safetensors converter;
# `torch` at module level). test_every_command_is_listed keeps this list whole.
TORCH_FREE_HELP = [
    "eval",
    "eval.serve",
    "eval.watch",
    "train.ledger",
    "dataloader.prepare",
    "train",
    "scripts/bench_cp_balance.py",
    "train.forensics",
    "scripts/bench_dataloader.py",
    "scripts/bench_eval.py",
    "scripts/bench_export.py",
    "scripts/bench_fp8_stats.py",
    "scripts/bench_heartbeats.py",
    "scripts/bench_ledger.py",
    "scripts/bench_plan.py",
    "scripts/bench_prepare.py",
    "scripts/bench_replica_groups.py",
    "scripts/bench_step_overhead.py",
    "scripts/bench_train.py",
    "scripts/gpu_check/__main__.py",
    "scripts/make_tasks.py",
    "scripts/plot_run.py",
    "scripts/quickstart.py",
    "scripts/replica_groups.py",
    "scripts/slurm/submit.py",
    "scripts/slurm/submit_prepare.py",
]
HELP_NEEDS_TORCH = ["eval.export"]


def test_every_command_is_listed():
    """A new argparse command joins the --help check (or says why it needs torch)."""
    commands = set()
    paths = [
        p for top in ("dataloader", "eval", "train", "scripts") for p in REPO.glob(f"{top}/**/*.py")
    ]
    for path in paths:
        rel = path.relative_to(REPO)
        if "ArgumentParser(" in path.read_text():
            if rel.parts[0] == "scripts":
                commands.add(rel.as_posix())
            else:
                module = ".".join(rel.with_suffix("").parts)
                commands.add(module.removesuffix(".__main__"))
    assert commands == set(TORCH_FREE_HELP + HELP_NEEDS_TORCH)


@pytest.mark.parametrize("command", TORCH_FREE_HELP)
def test_help_does_not_import_torch(command):
    """Asking a command for --help (or eval's HTTP client) must not pay for torch."""
    run = (
        f"runpy.run_path({command!r}, run_name='__main__')"
        if command.endswith(".py")
        else f"runpy.run_module({command!r}, run_name='__main__')"
    )
    probe = (
        "import runpy, sys\n"
        f"sys.argv = [{command!r}, '--help']\n"
        "try:\n"
        f"    {run}\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code\n"
        "else:\n"
        "    raise AssertionError('--help did not exit: not an argparse help')\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout, proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "NO-TORCH"


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (nested imports included)."""
    graph: dict[str, set[str]] = {}
    for package in ALLOWED:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            edges = set()
            for module, names, _ in imports_of(path):
                if module.split(".")[0] not in OURS:
                    continue
                # `from train.compat import cpu_compat` imports the module train.compat.cpu_compat
                submodules = {f"{module}.{n}" for n in names}
                found = {m for m in submodules if (root / (m.replace(".", "/") + ".py")).exists()}
                edges |= found or {module}
            graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph has none."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt in graph and nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_no_import_cycle_between_our_modules():
    """Function-level imports count: a cycle hidden inside a function is still a cycle."""
    assert find_cycle(import_graph()) == []


def test_the_cycle_finder_sees_a_nested_cycle(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "config.py").write_text("def f():\n    from train.model import g\n")
    (tmp_path / "train" / "model.py").write_text("from train.config import f\n")
    cycle = find_cycle(import_graph(tmp_path))
    assert cycle in (
        ["train.config", "train.model", "train.config"],
        ["train.model", "train.config", "train.model"],
    )


def test_the_run_config_schema_and_launch_rules_import_no_torch():
    """eval, the SLURM helpers and the launchers read configs and check a launch without the
    trainer."""
    probe = (
        "import sys, train.config, train.launch_rules; "
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "NO-TORCH"


# A room holds one job; past this, a module has grown a second (issue 25). Scripts and tests
# are not rooms of the pipeline and are not counted.
MAX_MODULE_LINES = 700
ROOMS = ("common", "dataloader", "train", "eval")


def oversized_modules(root: Path = REPO) -> list[str]:
    too_big = []
    for package in ROOMS:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_MODULE_LINES:
                too_big.append(
                    f"{path.relative_to(root)}: {lines} lines, over {MAX_MODULE_LINES}: it holds "
                    "more than one job; split it into modules of one job each "
                    "(docs/architecture.md)"
                )
    return too_big


def test_no_module_is_over_the_room_size():
    too_big = oversized_modules()
    assert not too_big, "\n".join(too_big)


def test_the_room_size_check_sees_a_big_module(tmp_path):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "eval" / "fits.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert oversized_modules(tmp_path) == [
        f"eval/big.py: {MAX_MODULE_LINES + 1} lines, over {MAX_MODULE_LINES}: it holds more than "
        "one job; split it into modules of one job each (docs/architecture.md)"
    ]
