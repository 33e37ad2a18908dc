"""The names and paths our prose points at exist: docstrings (of modules, classes and
functions), docs/*.md, README.md.

Why: the module docstrings are this project's essays, and they are what goes stale first. A
function moves (`prepare_runtime` from `train/__main__.py` to `train.runtime`), a module is
split, and the essay keeps sending the next reader to the old place, where nothing fails.
This test makes such a statement fail the suite, naming the file and the name.

What is checked:
- every backticked dotted name that starts with one of our packages (`common.`,
  `dataloader.`, `train.`, `eval.`, `scripts.`): a module, or an attribute reached from one
  (a function, a class, a constant, a class's method, field or `self.x` attribute, also
  inherited); a name that is not Python may be a run-config key (`dataloader.mix`, the
  `[dataloader]` table of `train.config.RunConfig`) or a file named by its bare name
  (`train.sbatch`);
- every path that starts with one of our top folders (`train/reliability/health.py`,
  `docs/contracts.md`, `tests/utils/runs.py`): it exists (a glob matches at least one file).

How, without importing anything: modules are found as files (ours in the repo, the
libraries' on `sys.path`) and read with `ast`, so the check takes a second and needs no
torch. A name imported into one of our modules counts only where it is meant to be read
from: a package's `__init__`, a name in `__all__`, or `import x as x`. Everywhere else an
imported name is a use, not a home, and a statement that names it there is stale. Names
of the libraries, only reached through an inherited attribute, are taken as they are.
"""

from __future__ import annotations

import ast
import builtins
import functools
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "dataloader", "train", "eval", "scripts")
TOP_FOLDERS = (*PACKAGES, "tests", "docs", "configs")
BACKTICKED = re.compile(r"`([^`\n]+)`")
DOTTED_NAME = re.compile(rf"(?<![\w/.\-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(rf"(?<![\w/.\-~$])((?:{'|'.join(TOP_FOLDERS)})/[\w./\-*]*[\w*])")
# a bare file name in backticks (`train.sbatch`), not a dotted Python name
FILE_SUFFIXES = {"py", "sh", "sbatch", "toml", "json", "jsonl", "md", "png", "txt", "log"}
# The run config's tables (`[dataloader]`): `dataloader.mix` is a TOML key, not Python.
RUN_CONFIG = "train.config.RunConfig"
# `configs/NAME.toml`, `docs/bench/dataloader-scale-DATE.md`: a path the reader fills in
PLACEHOLDER = re.compile(r"\b(NAME|DATE)\b")
# Paths the prose names that are not ours: upstream files, placeholders a reader fills in.
NOT_OUR_PATHS = {
    "scripts/estimate/estimation.py": "torchtitan's memory estimator, in its repository",
    "configs/x.toml": "an example file name in an error message",
    "configs/my_llama31_8b.toml": "the reader's own config, written in the doc's example",
    "eval/heldout/loss_at_L": "a TensorBoard tag, L the length",
    "eval/lm_eval/TASK/METRIC": "a TensorBoard tag of lm-eval's scores",
}


def docstrings(tree: ast.Module, where: str) -> list[tuple[str, str]]:
    """(where, text) for the docstring of a module and of each class and function in it,
    nested ones included (`where` names the file, then `Class.method`)."""
    texts = []
    doc = ast.get_docstring(tree, clean=False)
    if doc:
        texts.append((where, doc))

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child, clean=False)
                if doc:
                    texts.append((f"{where}:{name}", doc))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return texts


def prose() -> list[tuple[str, str]]:
    """(where, text): every module, class and function docstring of ours, docs/*.md and
    README.md."""
    texts = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            texts += docstrings(ast.parse(path.read_text()), str(path.relative_to(REPO)))
    for path in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        texts.append((str(path.relative_to(REPO)), path.read_text()))
    return texts


# ------------------------------------------------------------------ the resolver (no imports)


@dataclass(frozen=True)
class Module:
    name: str


@dataclass(frozen=True)
class Class:
    module: str
    node: ast.ClassDef


@dataclass(frozen=True)
class Leaf:
    """A function, a value or a field: nothing more to look into (its annotation aside)."""

    module: str
    annotation: ast.expr | None = None


@dataclass(frozen=True)
class Opaque:
    """Outside what `ast` can follow (a builtin, a module `__getattr__`): any attribute goes."""


Target = Module | Class | Leaf | Opaque


def is_ours(module: str) -> bool:
    return module.split(".")[0] in (*PACKAGES, "tests")


@functools.cache
def module_file(name: str) -> Path | None:
    """The file of module `name`, found without importing it (ours in the repo only)."""
    roots = [REPO] if is_ours(name) else [Path(p) for p in sys.path if p and Path(p).is_dir()]
    parts = name.split(".")
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        if not is_ours(name) and base.is_dir():  # a namespace package
            return base
    return None


@dataclass
class Namespace:
    bindings: dict[str, ast.AST]
    """name -> the statement that binds it at module level"""
    exported: set[str]
    """`__all__`"""
    star_from: list[str]
    """modules of `from m import *`"""
    dynamic: bool
    """a module-level `__getattr__`"""
    is_package: bool
    lazy_classes: dict[str, ast.ClassDef]
    """classes built inside a module-level function (`train.attention.DocumentMaskedSDPA`:
    built lazily so that importing the module loads no torch); named by their module"""


def _top_statements(body: list[ast.stmt]):
    """Module-level statements, also inside `if`/`try`/`with` (not inside defs)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list) and not isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            ):
                yield from _top_statements([n for n in inner if isinstance(n, ast.AST)])


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


@functools.cache
def namespace(module: str) -> Namespace | None:
    path = module_file(module)
    if path is None:
        return None
    if path.is_dir():
        return Namespace({}, set(), [], False, True, {})
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_bytes())
    bindings: dict[str, ast.AST] = {}
    exported: set[str] = set()
    star_from: list[str] = []
    dynamic = False
    lazy_classes: dict[str, ast.ClassDef] = {}
    for node in _top_statements(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bindings[node.name] = node
            dynamic |= node.name == "__getattr__"
            if not isinstance(node, ast.ClassDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ClassDef):
                        lazy_classes.setdefault(inner.name, inner)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        bindings[name.id] = node
                        if name.id == "__all__" and isinstance(node.value, ast.List | ast.Tuple):
                            exported |= {
                                e.value for e in node.value.elts if isinstance(e, ast.Constant)
                            }
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bindings[alias.asname or alias.name.split(".")[0]] = node
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node, is_package)
            for alias in node.names:
                if alias.name == "*":
                    star_from.append(source)
                else:
                    bindings[alias.asname or alias.name] = node
    return Namespace(bindings, exported, star_from, dynamic, is_package, lazy_classes)


def _import_target(module: str, node: ast.Import | ast.ImportFrom, name: str) -> Target | None:
    ns = namespace(module)
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname == name:
                return Module(alias.name)
            if alias.asname is None and alias.name.split(".")[0] == name:
                return Module(name)
        return None
    source = _absolute(module, node, ns.is_package)
    for alias in node.names:
        if (alias.asname or alias.name) == name:
            if module_file(f"{source}.{alias.name}") is not None:
                return Module(f"{source}.{alias.name}")
            return attribute(Module(source), alias.name, strict=False)
    return None


def _is_export(module: str, node: ast.AST, name: str) -> bool:
    """An imported name of our module counts as its own where it is meant to be read from."""
    if not isinstance(node, ast.Import | ast.ImportFrom):
        return True  # defined here
    ns = namespace(module)
    if not is_ours(module) or ns.is_package or name in ns.exported:
        return True
    return any(a.asname == name and a.name.split(".")[-1] == name for a in node.names)


def _binding_target(module: str, node: ast.AST, name: str) -> Target | None:
    if isinstance(node, ast.ClassDef):
        return Class(module, node)
    if isinstance(node, ast.Import | ast.ImportFrom):
        return _import_target(module, node, name)
    annotation = node.annotation if isinstance(node, ast.AnnAssign) else None
    return Leaf(module, annotation)


def _class_members(node: ast.ClassDef) -> dict[str, ast.AST]:
    members: dict[str, ast.AST] = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members[item.name] = item
        elif isinstance(item, ast.Assign | ast.AnnAssign):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    members[target.id] = item
    for item in ast.walk(node):  # `self.x = ...` in any method
        if (
            isinstance(item, ast.Attribute)
            and isinstance(item.ctx, ast.Store)
            and isinstance(item.value, ast.Name)
            and item.value.id == "self"
        ):
            members.setdefault(item.attr, item)
    return members


def _expression_target(module: str, expr: ast.expr) -> Target | None:
    """A base class or an annotation (`Name`, `a.b.Name`, a string of one) as a target."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        try:
            expr = ast.parse(expr.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(expr, ast.Subscript):  # Generic[T], list[X]: no attributes of X
        return None
    if isinstance(expr, ast.Name):
        if namespace(module) is not None and expr.id in namespace(module).bindings:
            return attribute(Module(module), expr.id, strict=False)
        return Opaque() if hasattr(builtins, expr.id) else None
    if isinstance(expr, ast.Attribute):
        owner = _expression_target(module, expr.value)
        return attribute(owner, expr.attr, strict=False) if owner is not None else None
    return None


def attribute(owner: Target, name: str, strict: bool = True) -> Target | None:
    """`owner.name`, or None when it does not exist. `strict`: an import in one of our
    modules (not a package, not in `__all__`) does not count as that module's name."""
    if isinstance(owner, Opaque):
        return Opaque()
    if isinstance(owner, Module):
        ns = namespace(owner.name)
        if ns is None:
            return None
        node = ns.bindings.get(name)
        if node is not None and (not strict or _is_export(owner.name, node, name)):
            return _binding_target(owner.name, node, name)
        if module_file(f"{owner.name}.{name}") is not None:
            return Module(f"{owner.name}.{name}")
        for source in ns.star_from:
            found = attribute(Module(source), name, strict=False)
            if found is not None:
                return found
        if ns.dynamic and (not ns.exported or name in ns.exported):
            return Opaque()
        if name in ns.lazy_classes:
            return Class(owner.name, ns.lazy_classes[name])
        return None
    if isinstance(owner, Class):
        member = _class_members(owner.node).get(name)
        if isinstance(member, ast.ClassDef):
            return Class(owner.module, member)
        if isinstance(member, ast.AnnAssign):
            return Leaf(owner.module, member.annotation)
        if member is not None:
            return Leaf(owner.module)
        for base in owner.node.bases:
            base_target = _expression_target(owner.module, base)
            if base_target is None:
                continue
            if isinstance(base_target, Opaque):
                base_name = ast.unparse(base)
                cls = getattr(builtins, base_name, None)
                if isinstance(cls, type):
                    if hasattr(cls, name):
                        return Opaque()
                    continue
                return Opaque()
            found = attribute(base_target, name, strict=False)
            if found is not None:
                return found
        return None
    if isinstance(owner, Leaf) and owner.annotation is not None:  # a field's type
        field_type = _expression_target(owner.module, owner.annotation)
        if isinstance(field_type, Class | Opaque):
            return attribute(field_type, name, strict=False)
    return None


def resolve(dotted: str) -> Target | None:
    """The module or attribute `dotted` names, found from its longest module prefix."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module = ".".join(parts[:split])
        if module_file(module) is None:
            continue
        target: Target | None = Module(module)
        for name in parts[split:]:
            target = attribute(target, name)
            if target is None:
                return None
        return target
    return None


@functools.cache
def repo_file_names() -> frozenset[str]:
    skip = {".git", ".venv", "__pycache__"}
    return frozenset(
        p.name
        for p in REPO.rglob("*")
        if p.is_file() and not skip & set(p.parts[len(REPO.parts) :])
    )


def name_problem(dotted: str) -> str | None:
    """Why `dotted` does not resolve, or None when it does."""
    if resolve(dotted) is not None:
        return None
    if resolve(f"{RUN_CONFIG}.{dotted}") is not None:  # `dataloader.mix`: a TOML key
        return None
    if (
        dotted.rsplit(".", 1)[-1] in FILE_SUFFIXES
        and dotted.rsplit("/", 1)[-1] in repo_file_names()
    ):
        return None
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module = ".".join(parts[:split])
        if module_file(module) is not None:
            if split == len(parts):
                return f"`{dotted}` does not resolve"
            return f"`{dotted}`: module {module} has no {'.'.join(parts[split:])}"
    return f"`{dotted}`: no such module"


def path_problem(path: str) -> str | None:
    if path in NOT_OUR_PATHS or PLACEHOLDER.search(path):
        return None
    if any(REPO.glob(path)):
        return None
    return f"{path}: no such file or folder"


def problems(where: str, text: str) -> list[str]:
    found = []
    for span in BACKTICKED.findall(text):
        for dotted in DOTTED_NAME.findall(span):
            problem = name_problem(dotted)
            if problem:
                found.append(f"{where}: {problem}")
    for path in PATH.findall(text):
        problem = path_problem(path.rstrip("."))
        if problem:
            found.append(f"{where}: {problem}")
    return sorted(set(found))


# ------------------------------------------------------------------ the tests


def test_every_name_and_path_in_our_prose_exists():
    found = [p for where, text in prose() for p in problems(where, text)]
    assert not found, "stale statements (fix the prose, or the name):\n" + "\n".join(found)


def test_a_broken_name_or_path_fails():
    docstring = """A synthetic essay.

    `train.runtime.prepare_runtime` sets the process up; `train.reliability.health.TrainingHealth` is
    the health of a run; `dataloader.TokenShardDataLoader` reads; `[[dataloader.mix]]`
    tables; `scripts/slurm/train.sbatch` or `train.sbatch`; `eval.serve.VLLMServer.url`.
    Stale: `train.runtime.prepare_runtimes`, `train.no_such_module`, `train.__main__.load_config`
    (imported there, defined in train.config), `common.io.free_port.nothing`, and
    `train/no_such_file.py`.
    """
    assert problems("synthetic", docstring) == [
        "synthetic: `common.io.free_port.nothing`: module common.io has no free_port.nothing",
        "synthetic: `train.__main__.load_config`: module train.__main__ has no load_config",
        "synthetic: `train.no_such_module`: module train has no no_such_module",
        "synthetic: `train.runtime.prepare_runtimes`: module train.runtime has no prepare_runtimes",
        "synthetic: train/no_such_file.py: no such file or folder",
    ]


def test_a_stale_name_in_a_method_docstring_fails():
    source = textwrap.dedent(
        '''
        """Module: `train.runtime.prepare_runtime`."""

        class Recorder:
            """Fine: `train.reliability.health.TrainingHealth`."""

            def record(self):
                """Stale: `train.reliability.health.prepare_runtime`."""

                def inner():
                    """Stale: `train/no_such_file.py`."""
        '''
    )
    texts = docstrings(ast.parse(source), "x.py")
    assert [where for where, _ in texts] == [
        "x.py",
        "x.py:Recorder",
        "x.py:Recorder.record",
        "x.py:Recorder.record.inner",
    ]
    assert [p for where, text in texts for p in problems(where, text)] == [
        "x.py:Recorder.record: `train.reliability.health.prepare_runtime`: module train.reliability.health has no "
        "prepare_runtime",
        "x.py:Recorder.record.inner: train/no_such_file.py: no such file or folder",
    ]


def test_the_resolver_follows_classes_fields_and_inheritance():
    # a method, a dataclass field's type, an inherited upstream method, an enum member
    assert isinstance(resolve("common.noise.Noise.pattern"), Leaf)
    assert resolve("train.config.RunConfig.dataloader.mix") is not None
    assert resolve("train.config.RunConfig.dataloader.no_such_key") is None
    assert resolve("common.exit_codes.ExitCode.HANG") is not None
    assert resolve("common.exit_codes.ExitCode.bit_length") is not None  # int's, inherited
    assert resolve("common.exit_codes.ExitCode.no_such_code") is None
