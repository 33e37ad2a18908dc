"""torchft 0.2.0 defects the replica groups work around, apart from our policy.

Stale rendezvous keys after a Lighthouse restart (`IncarnationGloo`). A Lighthouse keeps
its quorum ids in memory: a restarted one counts from 1 again. torchft's `Manager`
reconfigures its process group under the store prefix `torchft/{quorum_id}/{group_rank}`
of the first participant's store, so the new Lighthouse's quorum 1 meets the keys that the
old one's quorum 1 left there: gloo reads the old peers' addresses, fails to connect
("Gloo connectFullMesh failed ... Connection refused"), and the groups, whose quorum id no
longer changes, never reconfigure again: the run hangs until the watchdog ends it.
`tests/train/replica_groups/test_replica_groups.py::test_killed_groups_heal_from_a_peer_and_every_window_trains_once`
shows it (without this class the run stops with a hang verdict after the Lighthouse
restart). The fix: the launcher counts the Lighthouse's incarnations in RUN/lighthouse.json
(`scripts/replica_groups.py`, before it starts one), and the prefix gets the incarnation as
its last part, so each incarnation's quorums rendezvous under keys of their own. A group
that reads the file across a restart may configure under the old incarnation once; that
step fails its reduction, is not committed, and the next quorum configures everyone anew.
Retired when torchft's Lighthouse persists or randomizes its quorum ids (or its Manager
clears a quorum's keys), after which this class and the launcher's count can go.

One timeout for a process group's setup and its collectives (`IncarnationGloo` too): a
group that died just after asking for a quorum is in it, and each survivor sat out
torchft's collective timeout (minutes at scale) in the gloo setup. Here the setup waits
`rendezvous` (`train.replica_groups.build.ft_timeouts`), the collectives `timeout`. (The
NCCL group keeps torchft's one timeout: untested here.) Retired when torchft's process
groups take a setup timeout of their own.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torchft

LIGHTHOUSE_FILE_ENV = "TRAIN_LIGHTHOUSE_FILE"
"""RUN/lighthouse.json, as the launcher hands it to its groups."""


def lighthouse_incarnation() -> int:
    try:
        record = json.loads(Path(os.environ[LIGHTHOUSE_FILE_ENV]).read_text())
        return int(record.get("incarnation", 0))
    except (KeyError, OSError, ValueError):  # no file handed over, or none to read yet
        return 0


class IncarnationGloo(torchft.ProcessGroupGloo):
    """torchft's reconfigurable gloo group, its rendezvous prefix unique per Lighthouse
    incarnation, its setup bounded by `rendezvous` and its collectives by `timeout`."""

    def __init__(self, timeout: timedelta, rendezvous: timedelta) -> None:
        super().__init__(timeout=min(timeout, rendezvous))  # torchft's setup waits this
        self.collective_timeout = timeout

    def configure(self, store_addr: str, *args, **kwargs) -> None:
        super().configure(f"{store_addr}/lighthouse{lighthouse_incarnation()}", *args, **kwargs)
        self.parent._get_backend(torch.device("cpu"))._set_default_timeout(self.collective_timeout)
