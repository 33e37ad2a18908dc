"""train/ extends torchtitan by subclass plus `Config`, never by reassigning a method of a
built component, and never by rewriting an LR scheduler's `lr_lambdas` (issue 25).

Why a test: a method swapped in `__init__` (`self.optimizers.step = ...`) is a detour a
reader of the step cannot see; the behaviour belongs in a subclass that `train/build.py`
picks (train/components/optimizer.py, train/components/validator.py,
train/reliability/rollback.py, train/components/checkpoint.py). The check reads the source
(ast) of every module of train/ and names each:
- assignment to an attribute `lr_lambdas` (or `setattr(x, "lr_lambdas", ...)`);
- assignment of a function (a lambda, a def of the module, `functools.partial(...)`,
  `types.MethodType(...)`, a method of the enclosing class) to an attribute of a
  collaborator: `self.a.b = f`, or `x.b = f` where `x = self.a...` in the same function,
  or `setattr` of either. An attribute its class declares as a callback slot
  (`self.name: Callable[...] ... = ...`, e.g. `RunMetricsProcessor.extra_metrics_fn`) may
  be given one: it is an argument, not a method;
- assignment of a lambda or a nested def to an attribute of `self` (a wrapper replacing
  a component: `self.loss_fn = scaled_loss`).
Patches of a library module or class (`train/compat/cpu_compat.py`'s device shims, the DCP
daemon's entry point) are upstream workarounds, a different kind with rules of their own
(docs/architecture.md); they are not rooted at `self`.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _root(node: ast.expr) -> tuple[str | None, int]:
    """(the name an attribute chain starts at, how many attributes follow it)."""
    depth = 0
    while isinstance(node, ast.Attribute):
        node, depth = node.value, depth + 1
    return (node.id if isinstance(node, ast.Name) else None), depth


def callback_slots(sources: list[str]) -> set[str]:
    """Attributes declared `self.name: Callable...` (a slot meant to be given a function)."""
    slots = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Attribute)
                and _root(node.target) == ("self", 1)
                and "Callable" in ast.unparse(node.annotation)
            ):
                slots.add(node.target.attr)
    return slots


class _Finder(ast.NodeVisitor):
    def __init__(self, where: str, slots: set[str], module_defs: set[str]):
        self.where, self.slots, self.module_defs = where, slots, module_defs
        self.found: list[str] = []
        self.methods: list[set[str]] = []  # of each enclosing class
        self.nested: list[set[str]] = []  # defs inside each enclosing function
        self.aliases: list[set[str]] = []  # names bound to self.<attr>... in each function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        defs = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        self.methods.append(defs)
        self.generic_visit(node)
        self.methods.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        nested = {
            n.name
            for n in ast.walk(node)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n is not node
        }
        aliases = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Assign) and _root(n.value)[0] == "self" and _root(n.value)[1]:
                for target in n.targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    aliases |= {t.id for t in names if isinstance(t, ast.Name)}
        self.nested.append(nested)
        self.aliases.append(aliases)
        self.generic_visit(node)
        self.nested.pop()
        self.aliases.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _is_function(self, value: ast.expr) -> bool:
        if isinstance(value, ast.Lambda):
            return True
        if isinstance(value, ast.Name):
            return value.id in self.module_defs
        if isinstance(value, ast.Call):
            called = ast.unparse(value.func)
            return called.endswith(("partial", "MethodType"))
        if isinstance(value, ast.Attribute) and _root(value) == ("self", 1):
            return bool(self.methods) and value.attr in self.methods[-1]
        return False

    def _is_closure(self, value: ast.expr) -> bool:
        nested = self.nested[-1] if self.nested else set()
        return isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in nested)

    def _check(self, node: ast.AST, obj: ast.expr, attr: str, value: ast.expr | None) -> None:
        line = f"{self.where}:{node.lineno}: {ast.unparse(node).splitlines()[0]}"
        if attr == "lr_lambdas":
            self.found.append(line)
            return
        if value is None:
            return
        root, depth = _root(obj)
        aliases = self.aliases[-1] if self.aliases else set()
        on_collaborator = (root == "self" and depth >= 1) or root in aliases
        if on_collaborator and attr not in self.slots and self._is_function(value):
            self.found.append(line)
        elif root == "self" and depth == 0 and self._is_closure(value):
            self.found.append(line)

    def _assigned(self, node: ast.AST, targets: list[ast.expr], value: ast.expr | None) -> None:
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute):
                    self._check(node, t.value, t.attr, value)

    def visit_Assign(self, node: ast.Assign) -> None:
        self._assigned(node, node.targets, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._assigned(node, [node.target], node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._assigned(node, [node.target], None)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) == 3
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            self._check(node, node.args[0], node.args[1].value, node.args[2])
        self.generic_visit(node)


def patches(source: str, where: str, slots: set[str]) -> list[str]:
    """Each reassigned collaborator method or LR lambda in `source`, as `where:line: code`."""
    tree = ast.parse(source)
    module_defs = {
        n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    finder = _Finder(where, slots, module_defs)
    finder.visit(tree)
    return finder.found


def _train_sources() -> dict[str, str]:
    return {
        str(path.relative_to(REPO)): path.read_text()
        for path in sorted((REPO / "train").rglob("*.py"))
    }


def test_no_collaborator_method_or_lr_lambda_is_reassigned_in_train():
    sources = _train_sources()
    slots = callback_slots(list(sources.values()))
    assert "extra_metrics_fn" in slots  # RunMetricsProcessor's declared slot
    found = [line for where, source in sources.items() for line in patches(source, where, slots)]
    assert found == []


# what issue 25 found in train/trainer.py and train/reliability/health.py, and its kin
FORBIDDEN = {
    "optimizer step": """
        class T:
            def __init__(self):
                step = self.optimizers.step
                self.optimizers.step = lambda: None if self.health.check_step() else step()
    """,
    "loss function": """
        class T:
            def scale(self):
                loss_fn = self.loss_fn

                def scaled_loss(*args):
                    return loss_fn(*args) * 2

                self.loss_fn = scaled_loss
    """,
    "checkpoint save": """
        class T:
            def watch(self):
                save = self.checkpointer.save

                def watched_save(step, last_step=False):
                    return save(step, last_step)

                self.checkpointer.save = watched_save
    """,
    "validator through an alias": """
        class T:
            def watch(self):
                validator = self.validator

                def watched_batch_context():
                    return validator.validation_context()

                validator.validation_context = watched_batch_context
    """,
    "LR lambdas": """
        class H:
            def __init__(self, trainer):
                for scheduler in trainer.lr_schedulers:
                    scheduler.lr_lambdas = [wrap(f) for f in scheduler.lr_lambdas]
    """,
    "a bound method of our own": """
        class T:
            def _watched_save(self, step):
                pass

            def __init__(self):
                self.checkpointer.save = self._watched_save
    """,
    "partial": """
        import functools

        class T:
            def __init__(self):
                self.optimizers.step = functools.partial(run_step, self)
    """,
    "setattr": """
        class T:
            def __init__(self):
                setattr(self.validator, "validate", lambda parts, step: None)
    """,
}


@pytest.mark.parametrize("name", sorted(FORBIDDEN))
def test_the_check_finds_each_kind_of_reassignment(name):
    found = patches(textwrap.dedent(FORBIDDEN[name]), "snippet.py", slots=set())
    assert len(found) == 1, found


def test_the_check_lets_a_declared_slot_a_call_and_a_library_patch_pass():
    source = textwrap.dedent(
        """
        from collections.abc import Callable

        class Processor:
            def __init__(self):
                self.extra_metrics_fn: Callable[[int], dict] | None = None

        class T:
            def _extra_metrics(self, step):
                return {}

            def __init__(self):
                self.metrics_processor.extra_metrics_fn = self._extra_metrics
                self.optimizers.set_veto(self.health.check_step)
                self.step = 3
                self.health = Health(self.optimizers)

        def patch_library(shim):
            shim.empty_cache = lambda *a, **k: None
        """
    )
    assert patches(source, "snippet.py", callback_slots([source])) == []
