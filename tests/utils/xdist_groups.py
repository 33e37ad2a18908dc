"""Which tests share an xdist worker, for CI's two workers (.ci/run: `-n 2 --dist loadgroup`).

Why two workers: a test that sleeps, waits on a server or a SLURM job, or runs one process
leaves one of CI's 2 cores idle; a second worker fills it. What must share a worker:
- the users of a fixture of ours built once per module or session (a trained run, a fault
  run, the chaos run): it is built once per worker, so its users go to one worker and it
  is built once there. The cheap ones in `PER_WORKER` are built on each worker instead,
  which costs less than keeping their many users on one core;
- what exists once per machine: the SLURM clusters (one bridge and its namespaces) and the
  vLLM servers (one compile cache), one test at a time.
Everything else may run beside anything: the ports are random (common/io.py `free_port`),
the folders per test, and two tests at once load 2 cores far less than the shared machines
the suite is written on.

How: xdist's own `loadgroup` reads `xdist_group` marks into the node ids, which pytest 9's
node ids no longer take; so each worker writes {node id: group} to a file at collection
(`order_and_publish`) and the controller's scheduler (xdist's scope scheduler, a group for a
scope) reads it. A worker also puts the grouped and slow work first: a long test left for
the end would leave a core idle while it runs. A test marks a machine-wide thing that no
fixture shows with `pytest.mark.xdist_group(NAME)` (the quickstart's own vLLM server).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# Fixtures shared beyond a test that each worker may build for itself: seconds to build,
# and used by most of the training tests.
PER_WORKER = {"shakespeare_data", "tokenizer_dir", "short_docs_data", "tiny_checkpoint"}
# What exists once per machine, by the marker or fixture that uses it: a group each.
MACHINE_WIDE = {"slurm": "slurm", "vllm_cpu_server": "vllm"}


def _keys(item) -> tuple[list[str], list[str]]:
    """(the machine-wide things `item` touches, the shared fixtures of ours it uses)."""
    named = {MACHINE_WIDE.get(m.name) for m in item.iter_markers()}
    named |= {m.args[0] for m in item.iter_markers("xdist_group")}
    shared = []
    for name, defs in item._fixtureinfo.name2fixturedefs.items():
        fixture = defs[-1]  # the one this test gets; baseid "" is pytest's or a plugin's
        if name in MACHINE_WIDE:
            named.add(MACHINE_WIDE[name])
        elif fixture.scope != "function" and fixture.baseid and name not in PER_WORKER:
            module = item.nodeid.split("::")[0]
            shared.append(name if fixture.scope in ("session", "package") else f"{module}:{name}")
    return sorted(named - {None}), sorted(shared)


def groups(items) -> list[str | None]:
    """Each item's group (None: it may run anywhere). Tests that share any key share a
    group (union-find); a machine-wide name, where one is among them, names it."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys = [_keys(item) for item in items]
    machine_wide = {name for named, _ in keys for name in named}
    for named, shared in keys:
        first, *rest = named + shared or [None]
        for key in rest:
            a, b = sorted((root(first), root(key)), key=lambda r: r not in machine_wide)
            if a != b:
                parent[b] = a
    return [root((named + shared)[0]) if named or shared else None for named, shared in keys]


def order_and_publish(items, path: Path) -> None:
    """On a worker: sort `items` (machine-wide groups, then slow work, grouped first; a
    group stays together, in its order) and write {node id: group} to `path`."""
    found = groups(items)
    machine_wide = set(MACHINE_WIDE.values()) | {
        m.args[0] for item in items for m in item.iter_markers("xdist_group")
    }
    slow = {g for item, g in zip(items, found, strict=True) if item.get_closest_marker("slow")}
    first_at: dict = {}
    rank = {
        id(item): (
            group not in machine_wide,  # the longest chains: SLURM jobs, vLLM servers
            not (group in slow if group else item.get_closest_marker("slow")),
            group is None,
            first_at.setdefault(group or i, i),
        )
        for i, (item, group) in enumerate(zip(items, found, strict=True))
    }
    table = {item.nodeid: group for item, group in zip(items, found, strict=True) if group}
    items.sort(key=lambda item: rank[id(item)])
    # every worker writes the same table; a rename makes each write whole
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(table))
    os.replace(tmp, path)


def groups_file(config) -> Path:
    """Where this run's workers write their groups (one file per controller)."""
    if not hasattr(config, "_xdist_groups_file"):
        folder = tempfile.mkdtemp(prefix="xdist-groups-")
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
        config._xdist_groups_file = Path(folder) / "groups.json"
    return config._xdist_groups_file


def scheduler(config, log, path: Path):
    """xdist's scope scheduler with our groups as its scopes (read once every worker has
    collected, which is when xdist first asks for a scope)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        table: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.table is None:
                self.table = json.loads(path.read_text())
            return self.table.get(nodeid, nodeid)

    return GroupScheduling(config, log)
