"""common.process: a process that follows its parent (two plain Python processes, no
torch), as torchrun workers follow their launcher and the checkpoint daemon its worker. The
launcher itself killed with `kill -9` is tests/scripts/test_launchers.py's; whether a PID
is alive, through the run lease, tests/common/test_run_lease.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A child that follows its parent (common.process.follow_parent) and says when it saw it go.
FOLLOWER = """
import os, signal, sys, time
from common.process import follow_parent

only_poll = sys.argv[1] == "poll"
if only_poll:  # as if the main thread sat in one long C call: the signal's handler never runs
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])

def gone(parent):
    print(f"gone {parent}", flush=True)
    os._exit(7)

follow_parent(gone=gone, poll_s=0.2 if only_poll else 600)
print("ready", flush=True)
time.sleep(600)
"""
# Its parent: starts it from a thread that ends at once (the parent-death signal fires on
# that thread's exit), then lives on until the test kills it.
PARENT = """
import subprocess, sys, threading, time

def start():
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])

thread = threading.Thread(target=start)
thread.start()
thread.join()
print("thread gone", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("path", ["signal", "poll"])
def test_a_worker_follows_its_dead_parent_within_a_second(path):
    """Each of the two ways alone ends the child (the parent-death signal; the poll, with
    the signal held back), and the signal that the exit of the parent's spawning thread
    sends while the parent lives on is not taken for the parent's death."""
    repo = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, FOLLOWER, path],
        cwd=repo,
        env=dict(os.environ, PYTHONPATH=str(repo)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sorted([parent.stdout.readline(), parent.stdout.readline()]) == [
            "ready\n",
            "thread gone\n",
        ]
        time.sleep(0.5)  # the spawning thread's signal came and went: the child lives on
        assert parent.poll() is None
        parent.kill()
        killed_at = time.monotonic()
        assert parent.stdout.readline() == f"gone {parent.pid}\n"
        assert time.monotonic() - killed_at < 1.5
    finally:
        parent.kill()
        parent.wait()
