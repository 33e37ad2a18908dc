"""Benchmark the hang watchdog's heartbeat read: every rank's key one at a time (a `check`
and a `get` each, as before issue 34) against one `multi_get` (train/reliability/watchdog.py
`HangWatchdog._read_heartbeats`), on a real TCPStore.

    .venv/bin/python scripts/bench_heartbeats.py [--ranks 128,1024] [--repeat 5]
        [--out docs/bench/heartbeats-DATE.md]

One TCPStore server and one client in this process, over loopback (on a cluster the
store is the first node's torchrun agent, one network round trip away per request, so the
one-at-a-time read there costs 2 x ranks round trips and the multi_get one). Each rank's
key holds a heartbeat as the watchdog writes it. The median of `--repeat` reads of each
kind, side by side, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import timeit
from datetime import timedelta
from pathlib import Path


def one_at_a_time(store, keys: list[str]) -> list[bytes]:
    return [store.get(k) for k in keys if store.check([k])]


def multi_get(store, keys: list[str]) -> list[bytes]:
    return store.multi_get(keys) if store.check(keys) else []


def bench(ranks: int, repeat: int) -> dict:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=60))
    now = time.time()
    beat = {"seq": 42, "step": 1000, "host": "node0127", "pid": 123456, "time": now}
    beat |= {"where": "checkpoint save after step 1000", "window_ends": now + 300.0}
    keys = [f"watchdog/0/{r}" for r in range(ranks)]
    for key in keys:
        client.set(key, json.dumps(beat))
    result = {"ranks": ranks}
    for name, read in (("one_at_a_time", one_at_a_time), ("multi_get", multi_get)):
        assert len(read(client, keys)) == ranks
        times = timeit.repeat(lambda read=read: read(client, keys), number=1, repeat=repeat)
        result[f"{name}_ms"] = statistics.median(times) * 1e3
    result["ratio"] = result["one_at_a_time_ms"] / result["multi_get_ms"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench_heartbeats.py")
    parser.add_argument("--ranks", default="128,1024")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write a markdown report here")
    args = parser.parse_args(argv)
    from bench_common import versions, versions_line

    rows = [bench(int(n), args.repeat) for n in args.ranks.split(",")]
    lines = [
        f"Machine: {platform.machine()} {platform.node()}, {versions_line(versions(('torch',)))}"
        f"; {time.strftime('%Y-%m-%d')}; median of {args.repeat} "
        "reads each, one TCPStore server and client over loopback.",
        "",
        "| ranks | one key at a time (check + get) | one multi_get | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']:,} | {r['one_at_a_time_ms']:.1f} ms | {r['multi_get_ms']:.2f} ms "
            f"| {r['ratio']:.0f}x |"
        )
    report = "\n".join(lines)
    print(report)
    if args.out is not None:
        args.out.write_text(
            "# Heartbeat reads of the hang watchdog: one key at a time vs one multi_get\n\n"
            f"Command: `.venv/bin/python scripts/bench_heartbeats.py --ranks {args.ranks} "
            f"--repeat {args.repeat}`\n\n{report}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
