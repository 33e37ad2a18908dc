"""The exit-code table (`common.exit_codes`) is the only source of our exit numbers.

Python entry points return `ExitCode` members; shell scripts, which cannot import it, point
at it and use only its numbers. Both are scanned here, without running anything.
"""

from __future__ import annotations

import ast
import re

from common.exit_codes import ExitCode
from tests.utils.runs import REPO

SOURCE_DIRS = ("common", "dataloader", "train", "eval", "scripts")
# `exit N` as a command: at a line start or after `;`, `&&`, `||`, `{`, `then`, `else`
SHELL_EXIT = re.compile(r"(?:^|[;&|{]|\bthen|\belse)\s*exit\s+(\d+)\b")


def shell_exit_codes(text: str) -> set[int]:
    """The literal codes a shell script exits with (comments and quoted text left out)."""
    codes = set()
    for line in text.splitlines():
        code = line.split(" #", 1)[0]
        if code.lstrip().startswith("#"):
            continue
        code = re.sub(r"'[^']*'", "''", code)  # a quoted `exit 101` is a file's content
        codes.update(int(n) for n in SHELL_EXIT.findall(code))
    return codes


def test_shell_scripts_exit_only_with_the_tables_numbers_and_point_at_it():
    scripts = [*REPO.glob("scripts/**/*.sh"), *REPO.glob("scripts/**/*.sbatch")]
    seen = set()
    for path in scripts:
        text = path.read_text()
        codes = shell_exit_codes(text) - {ExitCode.OK}
        seen |= codes
        unknown = codes - set(ExitCode)
        assert not unknown, f"{path.relative_to(REPO)} exits {unknown}: not in common/exit_codes.py"
        if codes:
            assert "common/exit_codes.py" in text, (
                f"{path.relative_to(REPO)} exits {sorted(codes)}: name common/exit_codes.py "
                "in its header comment"
            )
    assert ExitCode.USER_ERROR in seen  # the scan sees the scripts' `exit 2`


def test_the_shell_scan_reads_commands_not_comments_or_strings():
    text = "# exit 7\nfoo || exit 5\nprintf '#!/bin/sh\\nexit 101\\n' >x\nif a; then exit 2; fi\n"
    assert shell_exit_codes(text) == {5, 2}


def literal_exit_codes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each exit number written as a literal: `return N` in a `main`,
    `sys.exit(N)` / `os._exit(N)`, or an `EXIT_*` constant given a number."""
    found = []

    def nonzero_int(node) -> bool:
        if isinstance(node, ast.IfExp):
            return nonzero_int(node.body) or nonzero_int(node.orelse)
        return isinstance(node, ast.Constant) and type(node.value) is int and node.value != 0

    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Return) and sub.value is not None and nonzero_int(sub.value):
                    found.append((sub.lineno, "return of a literal exit code in main()"))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "os._exit"):
            if node.args and nonzero_int(node.args[0]):
                found.append((node.lineno, f"{ast.unparse(node.func)} of a literal"))
        elif isinstance(node, ast.Assign) and nonzero_int(node.value):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.startswith("EXIT_"):
                    found.append((node.lineno, f"{target.id} defined outside the table"))
    return found


def test_python_entry_points_return_table_members_not_numbers():
    offenders = []
    for folder in SOURCE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "exit_codes.py" and path.parent.name == "common":
                continue
            tree = ast.parse(path.read_text())
            offenders += [f"{path.relative_to(REPO)}:{n}: {w}" for n, w in literal_exit_codes(tree)]
    assert not offenders, "use common.exit_codes.ExitCode:\n" + "\n".join(offenders)


def test_the_python_scan_sees_a_literal_code():
    tree = ast.parse("EXIT_X = 5\ndef main():\n    return 1 if bad else 0\nsys.exit(3)\n")
    assert [n for n, _ in literal_exit_codes(tree)] == [1, 3, 4]
