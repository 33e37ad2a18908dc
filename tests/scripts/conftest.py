"""Fixtures for the launcher tests: a real local SLURM cluster, one node or two (the
cluster and its helpers are in tests/utils/slurm.py, whose docstring says why it is real)."""

from __future__ import annotations

import pytest

from tests.utils.slurm import SlurmCluster, start_cluster, start_two_node_cluster


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory) -> SlurmCluster:
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def slurm_cluster_2node(tmp_path_factory) -> SlurmCluster:
    cluster = start_two_node_cluster(tmp_path_factory.mktemp("slurm2"))
    try:
        yield cluster
    finally:
        cluster.stop()
