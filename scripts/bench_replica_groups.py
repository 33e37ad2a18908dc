#!/usr/bin/env python3
"""Steps and wall time lost to one failure: torchft replica groups against today's requeue,
measured on CPU with gloo; and the goodput both paths predict at a stated failure rate at
the shipped configs' scales (docs/bench/replica_groups-*.md, docs/reliability.md).

    scripts/bench_replica_groups.py --data DATA [--steps 30] [--kill-after 14] [--out FILE]

Measured (same data, model, global batch of 6 sequences, checkpoint every 10 steps, each
run alone on this machine):
- requeue: one torchrun of 3 ranks (FSDP 3); kill -9 of the whole job after step K, then
  the relaunch that resumes from the last checkpoint (what SLURM's requeue does, without
  SLURM's own queueing delay);
- replica groups: 3 groups of 1 rank (`scripts/train_local.sh --replica-groups 3`); kill -9
  of one group after step K; the others train on, the launcher restarts it, it heals.
Each against its own uninterrupted run: wall time lost = failed run - clean run; steps
lost = steps trained again (requeue: since the checkpoint; replica groups: the uncommitted
attempts). Replica groups also train smaller steps while a group is down (shrink): counted
as slices deferred, not lost (the ledger shows every window trained once).

Predicted: per failure, requeue loses the restart (queue, start-up, checkpoint read at the
stated storage bandwidth) on every GPU plus half a checkpoint interval of steps; replica
groups lose the failed step on every GPU, plus one group's share of the time the dead group
takes to restart and heal, and pay the cross-group gradient reduction every step (counted
whole: an upper bound, since the sum overlaps the last micro-batch's backward). Step time
is the plan's (the shipped configs' headers, `python -m train --dry-run`); the rest are
stated assumptions printed with the table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.io import read_jsonl, run_cli  # noqa: E402

# ---------------------------------------------------------------- the failure rate
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384  # Llama 3 paper, sec. 3.3.4
FAILURES_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)

# ---------------------------------------------------------------- stated assumptions
REQUEUE_S = 300  # SLURM requeue + node allocation + process start-up + compile
GROUP_RESTART_S = 120  # one group's process start-up + compile on its nodes
STORAGE_GB_PER_S = 20.0  # checkpoint read bandwidth, all ranks together
INTERCONNECT_GB_PER_S = 50.0  # per GPU between nodes (400 Gb/s InfiniBand)
HEAL_PROBE_BYTES = 10**9  # the state a loopback heal moves to measure the transport
GPU = "h100"  # the planner's row the groups must fit (train/preflight.py check_gpu_memory)
BYTES_PER_PARAM = 16  # bf16 weights x2 copies + fp32 Adam moments x2: what a checkpoint holds


def _serve_state(queue, chunks: int) -> None:
    from datetime import timedelta

    import torch
    from torchft.checkpointing import HTTPTransport

    transport = HTTPTransport(timeout=timedelta(seconds=600), num_chunks=chunks)
    state = {f"t{i}": torch.randn(HEAL_PROBE_BYTES // 4 // 64) for i in range(64)}
    transport.send_checkpoint([1], 1, state, timedelta(seconds=600))
    queue.put(transport.metadata())
    time.sleep(3600)


def heal_rate(chunks: int = 4) -> float:
    """GB/s of a heal over torchft's HTTP transport (`chunks` streams, as
    `train.replica_groups.manager` configures it) on loopback: a sender process serves
    HEAL_PROBE_BYTES of fp32 tensors, this process fetches them. A ceiling for one rank's
    heal on this host; a cluster's link is its own figure (`replica_groups.heal_gb_per_s`)."""
    import multiprocessing as mp
    from datetime import timedelta

    from torchft.checkpointing import HTTPTransport

    spawn = mp.get_context("spawn")
    queue = spawn.Queue()
    sender = spawn.Process(target=_serve_state, args=(queue, chunks), daemon=True)
    sender.start()
    try:
        metadata = queue.get(timeout=300)
        receiver = HTTPTransport(timeout=timedelta(seconds=600), num_chunks=chunks)
        start = time.perf_counter()
        receiver.recv_checkpoint(1, metadata, 1, timedelta(seconds=600))
        seconds = time.perf_counter() - start
        receiver.shutdown(wait=False)
    finally:
        sender.kill()
    return HEAL_PROBE_BYTES / seconds / 1e9


def _ledger(path: Path) -> list[dict]:
    """The records so far (a line torn by the kill is skipped)."""
    return read_jsonl(path)[0] if path.is_file() else []


def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.2)


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children = collections.defaultdict(list)
    for p, parent in (map(int, line.split()) for line in out.splitlines()):
        children[parent].append(p)

    def below(p: int) -> list[int]:
        return [d for child in children[p] for d in (child, *below(child))]

    return below(pid)


def _config(data: Path, folder: Path, steps: int, replica: bool) -> Path:
    from tests.utils.runs import run_config, write_config

    sections = {
        "validation": {"enable": False},
        "training": {"steps": steps, "seq_len": 64, "local_batch_size": 2, "global_batch_size": 6},
        "checkpoint": {"interval": 10},
    }
    if replica:
        sections["replica_groups"] = {"groups": 3, "timeout_s": 30, "quorum_timeout_s": 120}
    return write_config(folder / "run.toml", run_config(data, folder / "run", sections))


def _launch(config: Path, replica: bool, log) -> subprocess.Popen:
    # 3 groups of one rank each, or one torchrun of 3 ranks
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), NPROC="1" if replica else "3")
    flags = ["--replica-groups", "3"] if replica else []
    cmd = [str(REPO / "scripts" / "train_local.sh"), *flags, str(config)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def measure(data: Path, steps: int, kill_after: int, replica: bool, fail: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = _config(data, folder, steps, replica)
        run = folder / "run"
        ledger = run / "replicas" / "0" / "ledger.jsonl" if replica else run / "ledger.jsonl"
        start = time.monotonic()
        with open(folder / "log", "w") as log:
            proc = _launch(config, replica, log)
            if fail:
                victim = run / "replicas" / "1" / "ledger.jsonl" if replica else ledger
                _wait(lambda: any(r.get("step") == kill_after for r in _ledger(victim)), 900)
                if replica:  # one group: its torchrun agent and worker
                    env_key = b"TRAIN_REPLICA_GROUP=1"
                    pids = [
                        p
                        for p in _descendants(proc.pid)
                        if env_key in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
                    ]
                else:  # the whole job
                    pids = [proc.pid, *_descendants(proc.pid)]
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if not replica:  # the requeue: the same launch again, resuming
                    proc.wait()
                    proc = _launch(config, replica, log)
            proc.wait(timeout=1800)
        wall = time.monotonic() - start
        if proc.returncode:
            raise RuntimeError(f"run failed: {(folder / 'log').read_text()[-3000:]}")
        records = _ledger(ledger)
        done = [r for r in records if r["kind"] == "step"]
        redone = len(done) - len({r["step"] for r in done})
        attempts = sum(r["kind"] == "attempt" for r in records)
        final = {r["step"]: r for r in done}
        deferred = sum(3 - r["quorum"]["live"] for r in final.values()) if replica else 0
        return {"wall_s": wall, "steps_redone": redone + attempts, "slices_deferred": deferred}


# ---------------------------------------------------------------- the goodput model
def shipped_scales() -> list[dict]:
    """(config, GPUs, tokens/s/GPU) from the shipped configs' plan headers, with their
    global batch, parameters and checkpoint interval."""
    from train.config import load_config

    rows = []
    for name in ("llama3_8b_fp8", "llama3_70b_fp8"):
        path = REPO / "configs" / f"{name}.toml"
        header = path.read_text()
        run = load_config(str(path), [])
        m = run.model
        attention = 4 * m.dim * m.dim * (1 + m.n_kv_heads / m.n_heads) / 2
        params = m.n_layers * (attention + 3 * m.dim * m.ffn_hidden_dim) + 2 * m.vocab_size * m.dim
        tokens = run.training.global_batch_size * run.training.seq_len
        shared = {"config": name, "run": run, "params": params, "interval": run.checkpoint.interval}
        plans = re.findall(r"--world-size (\d+) --gpu h100\):\n#\s+([\d,]+) tokens/s/GPU", header)
        for gpus, tps in plans:
            gpus, tps = int(gpus), float(tps.replace(",", ""))
            rows.append(shared | {"gpus": gpus, "step_s": tokens / (gpus * tps)})
        # Llama 3's own scale, extrapolated: the largest plan's tokens/s/GPU, the global
        # batch grown with the GPUs so the step time stays the plan's
        rows.append(rows[-1] | {"gpus": LLAMA3_GPUS, "extrapolated": True})
    return rows


def group_state(row: dict, groups: int) -> int | None:
    """A rank's state in a group of `row`'s GPUs / `groups` at the config's tp and cp (what a
    heal moves), or None when that group cannot launch: fewer GPUs than tp x cp, or a
    state with the replica sum's copy that exceeds the GPU (`train.preflight.
    check_gpu_memory`, as the launchers check; the batch grows with the GPUs here)."""
    from dataclasses import replace

    from train.config import ConfigError
    from train.preflight import check_gpu_memory, staged_state_dict

    run, p = row["run"], row["run"].parallelism
    run = replace(run, replica_groups=replace(run.replica_groups, groups=groups))
    dp_shard, rest = divmod(row["gpus"] // groups, p.tp * p.cp)
    degrees = {"dp_replicate": 1, "dp_shard": dp_shard, "tp": p.tp, "cp": p.cp}
    try:
        if not dp_shard or rest:
            return None
        check_gpu_memory(run, degrees, GPU)
    except ConfigError:
        return None
    return staged_state_dict(run, degrees).bytes


def best_goodput(row: dict, heal_gb_per_s: float) -> dict | None:
    """The goodput of the best number of groups, 2, 4, 8, ..., of those that launch (fewer,
    larger groups reduce less per rank; more, smaller ones lose less to each failure);
    None when no number of groups launches at this scale."""
    sizes = (2**i for i in range(1, row["gpus"].bit_length()))  # 2, 4, ... up to the GPUs
    states = {groups: s for groups in sizes if (s := group_state(row, groups)) is not None}
    candidates = [goodput(row, groups, s / 1e9 / heal_gb_per_s) for groups, s in states.items()]
    return max(candidates, key=lambda g: g["replica"], default=None)


def goodput(row: dict, groups: int, heal_s: float) -> dict:
    gpus, step_s, interval, params = row["gpus"], row["step_s"], row["interval"], row["params"]
    rate_per_s = FAILURES_PER_GPU_HOUR * gpus / 3600
    checkpoint_gb = params * BYTES_PER_PARAM / 1e9
    requeue_loss_s = REQUEUE_S + checkpoint_gb / STORAGE_GB_PER_S + interval / 2 * step_s
    requeue = 1 / (1 + rate_per_s * requeue_loss_s)
    group_gpus = gpus // groups
    shard_gb = params * 4 / group_gpus / 1e9  # fp32 gradient shard per rank
    reduce_s = 2 * shard_gb * (groups - 1) / groups / INTERCONNECT_GB_PER_S
    replica_loss_s = step_s + (GROUP_RESTART_S + heal_s) / groups
    replica = step_s / (step_s + reduce_s) / (1 + rate_per_s * replica_loss_s)
    return {
        "groups": groups,
        "heal_s": heal_s,
        "failures_per_day": rate_per_s * 86400,
        "requeue_loss_s": requeue_loss_s,
        "requeue": requeue,
        "replica_loss_s": replica_loss_s,
        "reduce_s": reduce_s,
        "replica": replica,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench_replica_groups.py", description=__doc__)
    parser.add_argument("--data", help="a prepared DATA dir (tokenizer/, train/); none: model only")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-after", type=int, default=14)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--heal-gb-per-s", type=float, help="a heal's rate a rank; default: measured on loopback"
    )
    args = parser.parse_args(argv)

    def body() -> int:
        rate = args.heal_gb_per_s or heal_rate()
        results: dict = {"model": [], "measured": {}, "heal_gb_per_s": rate}
        print(
            f"failure rate: Llama 3's {LLAMA3_INTERRUPTIONS} interruptions in {LLAMA3_DAYS} days "
            f"on {LLAMA3_GPUS} GPUs = {FAILURES_PER_GPU_HOUR:.3g} per GPU-hour; requeue "
            f"{REQUEUE_S} s, group restart {GROUP_RESTART_S} s, storage {STORAGE_GB_PER_S} GB/s, "
            f"interconnect {INTERCONNECT_GB_PER_S} GB/s/GPU, heal {rate:.3g} GB/s a rank "
            f"({'given' if args.heal_gb_per_s else 'torchft HTTP transport, loopback, measured'}); "
            f"groups that fit a {GPU}"
        )
        print(
            "| config | GPUs | groups | step (s) | failures/day | lost per failure: requeue / groups (s) "
            "| reduce/step (s) | goodput requeue | goodput groups |"
        )
        for row in shipped_scales():
            g = best_goodput(row, rate)
            if g is None:  # no group of this scale holds the state: not launchable
                continue
            results["model"].append({k: v for k, v in row.items() if k != "run"} | g)
            print(
                f"| {row['config']} | {row['gpus']}{'*' if row.get('extrapolated') else ''} "
                f"| {g['groups']} | {row['step_s']:.2f} | {g['failures_per_day']:.2f} "
                f"| {g['requeue_loss_s']:.0f} / {g['replica_loss_s']:.0f} | {g['reduce_s']:.2f} "
                f"| {g['requeue']:.4f} | {g['replica']:.4f} |"
            )
        if args.data:
            for replica in (False, True):
                name = "replica_groups" if replica else "requeue"
                clean = measure(Path(args.data), args.steps, args.kill_after, replica, fail=False)
                failed = measure(Path(args.data), args.steps, args.kill_after, replica, fail=True)
                results["measured"][name] = {"clean": clean, "failed": failed}
                print(
                    f"{name}: clean {clean['wall_s']:.1f} s, one failure {failed['wall_s']:.1f} s "
                    f"(+{failed['wall_s'] - clean['wall_s']:.1f} s), steps trained again "
                    f"{failed['steps_redone']}, slices deferred {failed['slices_deferred']}"
                )
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
