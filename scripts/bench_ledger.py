"""Benchmark the data ledger: bytes and time per step on the trainer, and `verify`'s time
per step, against corpus size (up to 1e9 documents), steps and global batch.

    .venv/bin/python scripts/bench_ledger.py [--sizes 1e5,1e7,1e9] [--batches 8,64,512]
        [--steps 250,1000] [--workdir DIR] [--out docs/bench/ledger-DATE]

Per corpus size (bench_dataloader's synthetic corpus: a real documents.npy, sparse
shards), per global batch B (one rank taking whole steps, seq_len 2048: the rows a step
records whatever the number of ranks) and per step count, a real `TokenShardDataLoader`
feeds the real `train.ledger.recorder.DataLedgerRecorder`:

- baseline: the loader's own `next()` per step (reading B x 2048 tokens), beside
- the ledger's cost on a rank: hashing the step's rows (`StepTap`, inside `next()`), and
  rank 0's record (position to JSON, the chained line appended and fsynced);
- bytes per step of RUN/ledger.jsonl;
- `verify`'s time per step (the whole ledger recomputed) and `which` for one step (its
  documents found through documents.npy at the corpus' size);
- one all_reduce of five int64 on 2 gloo processes (the collective the recorder added until
  its lanes rode in the step's one exchange, `train.reliability.exchange`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import bench_common  # noqa: E402

SEQ_LEN = 2048


def _corpus(root: Path, num_docs: int) -> Path:
    from bench_dataloader import synthetic_corpus

    split = root / f"docs_{num_docs}" / "train"
    if not (split / "manifest.json").is_file():
        synthetic_corpus(split.parent, num_docs)
    return split


def _measure(split: Path, batch: int, steps: int, run_dir: Path) -> dict:
    from dataloader.ledger_record import NUM_LANES, add_rows
    from train.ledger.readers import which
    from train.ledger.recorder import DataLedgerRecorder
    from train.ledger.replay import Replay

    loader = bench_common.token_loader(split, SEQ_LEN, batch, prefetch=0)
    recorder = DataLedgerRecorder(loader, run_folder=run_dir, micro_batches=1, fresh=False)
    next_s = hash_s = record_s = 0.0
    for step in range(1, steps + 1):
        # next() includes the tap's hashing: timed apart below and subtracted
        next_s += bench_common.timed(next, loader)[1]
        origins = zip(loader.last_origins, loader.last_sequences, strict=True)
        plan = [(d, s, e, n) for (d, e, s), n in origins]
        hash_s += bench_common.timed(add_rows, [0] * NUM_LANES, plan, SEQ_LEN)[1]
        record_s += bench_common.timed(recorder.after_step, step, skipped=False)[1]
    replay, verify_s = bench_common.timed(Replay(run_dir).run)
    assert replay.first_bad is None, replay.first_bad.line()
    (_, rows), which_s = bench_common.timed(which, run_dir, steps // 2)
    return {
        "steps": steps,
        "global_batch": batch,
        "loader_next_ms": 1e3 * (next_s - hash_s) / steps,
        "ledger_hash_ms": 1e3 * hash_s / steps,
        "ledger_record_ms": 1e3 * record_s / steps,
        "bytes_per_step": (run_dir / "ledger.jsonl").stat().st_size / steps,
        "verify_ms_per_step": 1e3 * verify_s / steps,
        "which_ms": 1e3 * which_s,
        "which_documents": sum(len(r.documents) for r in rows),
    }


def _all_reduce_child(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    lanes = torch.arange(5, dtype=torch.int64)

    def once():
        summed = lanes.clone()
        dist.all_reduce(summed)
        summed.tolist()

    timeit.timeit(once, number=50)  # warm
    seconds = timeit.timeit(once, number=1000)  # x 1e3: microseconds per call
    if rank == 0:
        Path(out).write_text(json.dumps({"gloo_all_reduce_us": seconds * 1e3}))
    dist.destroy_process_group()


def _all_reduce_us() -> float:
    import torch.multiprocessing as mp

    from common.io import free_port

    out = Path(tempfile.mkdtemp()) / "all_reduce.json"
    mp.spawn(_all_reduce_child, args=(free_port(), str(out)), nprocs=2)
    return json.loads(out.read_text())["gloo_all_reduce_us"]


def _table(rows: list[dict]) -> str:
    head = (
        "| documents | global batch | steps | loader next() ms/step (baseline) | ledger hash ms/step "
        "| ledger record ms/step (rank 0, fsync) | bytes/step | verify ms/step | which ms (docs) |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "".join(
        f"| {r['documents']:,} | {r['global_batch']} | {r['steps']} | {r['loader_next_ms']:.3f} | "
        f"{r['ledger_hash_ms']:.3f} | {r['ledger_record_ms']:.3f} | {r['bytes_per_step']:.0f} | "
        f"{r['verify_ms_per_step']:.3f} | {r['which_ms']:.1f} ({r['which_documents']}) |\n"
        for r in rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1e5,1e7,1e9", help="corpus sizes in documents")
    parser.add_argument("--batches", default="8,64,512", help="global batch sizes (sequences)")
    parser.add_argument("--steps", default="250,1000", help="step counts")
    parser.add_argument("--workdir", type=Path, help="where the corpora go (kept if given)")
    parser.add_argument("--out", help="write the numbers to OUT.json (the table is printed)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with bench_common.work_dir(args.workdir, "bench_ledger_") as root:
        for num_docs in [int(float(s)) for s in args.sizes.split(",")]:
            split, took = bench_common.timed(_corpus, root, num_docs)
            print(f"## {num_docs:,} documents: corpus in {took:.1f} s", flush=True)
            batches = [int(b) for b in args.batches.split(",")]
            step_counts = [int(s) for s in args.steps.split(",")]
            for batch, steps in itertools.product(batches, step_counts):
                with tempfile.TemporaryDirectory(prefix="bench_ledger_run_") as run_dir:
                    row = {"documents": num_docs, **_measure(split, batch, steps, Path(run_dir))}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.workdir is None:
                shutil.rmtree(split.parent)  # disk is shared: one size at a time
    collective = _all_reduce_us()
    print(json.dumps({"gloo_all_reduce_us": collective}), flush=True)
    found = bench_common.versions_line(bench_common.versions(("numpy", "torch")))
    found += f"; {bench_common.device_name()}"
    if args.out:
        report = {"rows": rows, "gloo_all_reduce_us": collective, "versions": found}
        Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(_table(rows))
    print(f"gloo all_reduce of 5 int64, 2 processes: {collective:.0f} us; {found}")


if __name__ == "__main__":
    main()
