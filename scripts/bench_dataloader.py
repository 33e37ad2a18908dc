"""Benchmark the data pipeline: loader throughput, startup, resume, prepare, stock loader.

    .venv/bin/python scripts/bench_dataloader.py [--quick] [--workdir DIR]

Everything runs on the real Shakespeare corpus (prepared here with a freshly trained
2048-token BPE) or on synthetic shard sets; nothing is downloaded. Tokenizers'
Rayon pool is pinned to one thread so the prepare-vs-encode_batch comparison is per core.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers is imported: per-core numbers
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402


def time_to_first_batch(path: Path, state: dict | None = None) -> float:
    def first():
        loader = bench_common.token_loader(path)
        if state is not None:
            loader.load_state_dict(state)
        next(loader)

    return bench_common.timed(first)[1]


def stock_loader_throughput(data: Path, workdir: Path, seq_len: int, batch: int, seconds: float):
    """torchtitan's HuggingFaceTextDataLoader on the same documents (a local jsonl dir)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from dataloader.corpus import iter_documents

    jsonl_dir = workdir / "stock_jsonl"
    jsonl_dir.mkdir(exist_ok=True)
    with open(jsonl_dir / "data.jsonl", "w") as fh:
        for doc in iter_documents(["shakespeare"]):
            fh.write(json.dumps({"text": doc.text}) + "\n")
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(data / "tokenizer"))
    loader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(jsonl_dir)).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=batch
    )
    num_batches, elapsed = bench_common.rate(iter(loader).__next__, seconds)
    return num_batches * batch * seq_len / elapsed


def prepare_throughput(data: Path, workdir: Path) -> tuple[float, float]:
    """(prepare tokens/s with one worker, raw encode_batch tokens/s), both on one core."""
    from tokenizers import Tokenizer

    from dataloader.corpus import iter_documents
    from dataloader.prepare import PrepareConfig, prepare

    texts = [d.text for d in iter_documents(["shakespeare"]) if d.text.strip()]
    tokenizer = Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json"))
    encoded, raw_s = bench_common.timed(tokenizer.encode_batch, texts, add_special_tokens=False)
    config = PrepareConfig(
        ["shakespeare"], workdir / "prep", str(data / "tokenizer"), num_workers=1, progress=False
    )
    manifests, prepare_s = bench_common.timed(prepare, config)
    return manifests["train"].num_tokens / prepare_s, sum(len(e.ids) + 2 for e in encoded) / raw_s


# ---------------------------------------------------------------------------------------
# --scale: cost versus corpus size, ours vs the format-1 loader vs Megatron vs OLMo-core
# ---------------------------------------------------------------------------------------
SCALE_WORLD, SCALE_RANK, SCALE_BATCH, SCALE_SEQ = 64, 5, 1, 8192
SHARD_TOKENS = 1 << 30  # synthetic shards of ~1 Gi tokens (2 GiB), cut at document ends
FORMAT1_COMMIT = "8166cc5"  # the last commit with the format-1 (document-shuffle) loader


def _rss_mb(key: str = "VmRSS") -> float:
    """This process's resident memory, or (`VmHWM`) its peak. Not ru_maxrss for the peak:
    Linux carries that over exec from the forking parent, which had just written the 8 GB
    index (a 7.5 GB artefact)."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return next((int(x.split()[1]) / 1024 for x in lines if x.startswith(key + ":")), float("nan"))


def synthetic_corpus(
    root: Path, num_docs: int, seed: int = 0, shard_tokens: int = SHARD_TOKENS, fill: bool = False
) -> Path:
    """A prepared split of `num_docs` documents of 500..1500 tokens (mean ~1000).

    documents.npy is real (written in chunks, 8 bytes per document); the shard files are
    sparse (they read as token 0), so 1e12 tokens cost 8 GB of disk, not 2 TB, unless
    `fill` writes real random tokens (reads that must reach the disk). The manifest's
    sha256 fields are placeholders: no loader verifies them at start-up.
    """
    from dataloader.manifest import DOCUMENTS_NAME, ShardInfo, write_untokenized_manifest

    split = root / "train"
    (split / "shards").mkdir(parents=True, exist_ok=True)
    starts = np.lib.format.open_memmap(
        split / DOCUMENTS_NAME, mode="w+", dtype=np.int64, shape=(num_docs + 1,)
    )
    rng = np.random.default_rng(seed)
    starts[0], chunk, total = 0, 1 << 24, 0
    for lo in range(0, num_docs, chunk):
        lengths = rng.integers(500, 1501, size=min(chunk, num_docs - lo), dtype=np.int64)
        np.cumsum(lengths, out=starts[lo + 1 : lo + 1 + lengths.size])
        starts[lo + 1 : lo + 1 + lengths.size] += total
        total = int(starts[lo + lengths.size])
    starts.flush()
    # Shard j ends at the first document start >= (j+1) * shard_tokens (documents never straddle).
    cuts = [0]
    while cuts[-1] < total:
        doc = int(np.searchsorted(starts, cuts[-1] + shard_tokens, side="left"))
        cuts.append(int(starts[min(doc, num_docs)]))
    doc_cuts = np.searchsorted(starts, cuts, side="left")
    shards = []
    for j in range(len(cuts) - 1):
        name, size = f"shards/{j:05d}.bin", cuts[j + 1] - cuts[j]
        with open(split / name, "wb") as fh:
            if fill:
                rng.integers(2, 2048, size=size, dtype=np.uint16).tofile(fh)
            else:
                fh.truncate(size * 2)  # sparse
        shards.append(ShardInfo(name, size, int(doc_cuts[j + 1] - doc_cuts[j]), size * 2, "0" * 64))
    del starts
    write_untokenized_manifest(split, shards, 2048)
    return split


def megatron_files(split: Path, prefix: Path) -> None:
    """Megatron's IndexedDataset (.bin sparse, .idx real) for the same documents."""
    import struct

    from dataloader.manifest import Manifest

    manifest = Manifest.load(split, check_files=False)
    starts = np.load(split / "documents.npy", mmap_mode="r")
    n = manifest.num_documents
    with open(f"{prefix}.bin", "wb") as fh:
        fh.truncate(manifest.num_tokens * 2)
    chunk = 1 << 24
    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))  # uint16
        fh.write(struct.pack("<Q", n) + struct.pack("<Q", n + 1))
        for lo in range(0, n, chunk):  # sequence lengths (int32)
            fh.write(np.diff(starts[lo : min(n, lo + chunk) + 1]).astype(np.int32).tobytes())
        for lo in range(0, n, chunk):  # byte pointers (int64)
            fh.write((np.asarray(starts[lo : min(n, lo + chunk)]) * 2).tobytes())
        for lo in range(0, n + 1, chunk):  # document indices 0..n (int64)
            fh.write(np.arange(lo, min(n + 1, lo + chunk), dtype=np.int64).tobytes())


# Each design at rank SCALE_RANK of SCALE_WORLD: `build(cursor)` is a new loader resumed
# `cursor` sequences in, as the zero-argument call that yields its next batch.
def ours(split: Path, design: str):
    """Our loader, or (`format1`) the loader of that commit, as a module of its own."""
    from dataloader import loader as module  # imported outside the timings

    if design == "format1":
        module = sys.modules["format1_loader"] = types.ModuleType("format1_loader")
        source = bench_common.source_at(FORMAT1_COMMIT, "dataloader/loader.py")
        exec(compile(source, "format1_loader.py", "exec"), module.__dict__)
    extra = {"prefetch": 0} if design == "ours" else {}  # synchronous, like the peers here

    def build(cursor: int = 0):
        loader = bench_common.token_loader(
            split, SCALE_SEQ, SCALE_BATCH, SCALE_WORLD, SCALE_RANK, module, **extra
        )
        if cursor:
            loader.load_state_dict(deep_state(loader, cursor))
        return loader.__next__

    return build


def deep_state(loader, cursor: int) -> dict:
    """`loader`'s state as if `cursor` sequences had been read. Format 3 seeks by block
    position, not by sequence count: there it is the start of the group that holds the
    cursor."""
    template = loader.state_dict()
    saved = json.loads(template["state_json"])
    dataset = saved["datasets"][0]
    dataset["sequences_consumed"] = cursor
    if saved.get("format_version", 1) >= 3:
        d = loader.datasets[0]
        windows_per_epoch = (d.num_tokens - 1) // loader.seq_len
        epoch, rest = divmod(cursor, windows_per_epoch)
        group = min(d.num_groups - 1, rest * d.num_groups // windows_per_epoch)
        dataset["block_position"], dataset["skipped_tokens"] = [epoch, group, 0, 0], 0
    return dict(template, num_sequences_consumed=cursor, state_json=json.dumps(saved))


def megatron(prefix: Path, num_samples: int, cache: Path):
    """megatron-core GPTDataset + Megatron's pretraining sampler arithmetic (rank r of W
    takes sample consumed + r*B .. ; indices built by the first build, then memory-mapped)."""

    def build(consumed: int = 0):
        from types import SimpleNamespace

        import torch
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        tokenizer = SimpleNamespace(eod=1, pad=2**31 - 1, vocab_size=2048, unique_identifiers={})
        config = GPTDatasetConfig(
            random_seed=0,
            sequence_length=SCALE_SEQ,
            blend=([str(prefix)], None),
            split="1,0,0",
            path_to_cache=str(cache),
            tokenizer=tokenizer,
            reset_position_ids=True,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
        )
        builder = BlendedMegatronDatasetBuilder(
            GPTDataset, [num_samples, 0, 0], lambda: True, config
        )
        dataset = builder.build()[0]

        def take():
            nonlocal consumed
            index = consumed + SCALE_RANK * SCALE_BATCH
            consumed += SCALE_WORLD * SCALE_BATCH
            return torch.stack([dataset[index + i]["tokens"] for i in range(SCALE_BATCH)])

        return take

    return build


def olmo(split: Path, folder: Path):
    """OLMo-core NumpyFSLDataset + NumpyFSLDataLoader (global shuffled instance indices,
    built once by rank 0 into `folder` and memory-mapped); also the index build alone."""
    from dataloader.manifest import Manifest

    paths = [str(split / s.file) for s in Manifest.load(split, check_files=False).shards]

    def loader():
        from olmo_core.data import DataCollator, NumpyDataLoaderBase, NumpyFSLDataset

        dataset = NumpyFSLDataset(
            *paths,
            sequence_length=SCALE_SEQ,
            pad_token_id=2,
            eos_token_id=1,
            vocab_size=2048,
            dtype=np.uint16,
        )
        dataset.work_dir = folder
        dataset.prepare()
        return NumpyDataLoaderBase.wrap_numpy_dataset(
            dataset,
            global_batch_size=SCALE_WORLD * SCALE_BATCH * SCALE_SEQ,
            collator=DataCollator(pad_token_id=2),
            work_dir=folder,
            dp_world_size=SCALE_WORLD,
            dp_rank=SCALE_RANK,
            fs_local_rank=0,
            seed=0,
        )

    def build(cursor: int = 0):
        built = loader()
        if cursor:
            state = built.state_dict()
            state |= {"batches_processed": cursor // (SCALE_WORLD * SCALE_BATCH), "epoch": 1}
            built.load_state_dict(state)
        built.reshuffle(epoch=1)
        return iter(built).__next__

    return build, lambda: loader().reshuffle(epoch=1)


def measure_child(impl: str, data: Path, seconds: float) -> dict:
    """Runs in a fresh process: build, first batch, steady tokens/s, resume, peak RSS."""
    from dataloader.manifest import Manifest

    split = data / "train"
    num_tokens = Manifest.load(split, check_files=False).num_tokens
    samples, index = num_tokens // SCALE_SEQ, None
    if impl in ("ours", "format1"):
        build = ours(split, impl)
        # deep in epoch 3: sequence 2.5 epochs in (format 1: 2.5 epochs of tokens)
        deep = 2.5 * ((num_tokens - 1) // SCALE_SEQ)
    else:
        import torch  # noqa: F401  (import cost outside the timings, as for ours)

        if impl == "megatron":
            cache = data / "megatron_cache"
            build = index = megatron(data / "megatron" / "corpus", 3 * samples, cache)
            deep = 2.5 * samples
        else:
            build, index = olmo(split, data / "olmo_work")
            deep = 0.5 * samples
    deep = int(deep) // SCALE_WORLD * SCALE_WORLD
    out = {"impl": impl}
    if index is not None:
        # The one-off index build (rank 0, before training); every rank then memory-maps it.
        before = _rss_mb()
        out["index_build_s"] = bench_common.timed(index)[1]
        out["index_build_rss_mb"] = _rss_mb("VmHWM") - before
    gc_base = _rss_mb()
    take, out["build_s"] = bench_common.timed(build)
    out["first_batch_s"] = bench_common.timed(take)[1]
    # a small corpus's epoch may end the window (OLMo-core stops at its end)
    num, elapsed = bench_common.rate(take, seconds, warm=False)
    out["tokens_per_s"] = num * SCALE_BATCH * SCALE_SEQ / elapsed
    out["resume_s"] = bench_common.timed(lambda: build(deep)())[1]
    out["peak_rss_above_interpreter_mb"] = _rss_mb("VmHWM") - gc_base
    out["interpreter_rss_mb"] = gc_base
    return out


def run_child(python: str, impl: str, data: Path, seconds: float, timeout: float) -> dict:
    import subprocess

    cmd = [python, __file__, "--measure", impl, "--workdir", str(data), "--seconds", str(seconds)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "error": f"did not finish within {timeout:.0f} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        tail = (result.stderr.strip().splitlines() or ["?"])[-1]
        return {"impl": impl, "error": f"exit {result.returncode}: {tail[:300]}"}
    return json.loads(lines[-1])


def scale_main(args) -> None:
    rows = []
    if args.append and args.out and Path(args.out).with_suffix(".json").exists():
        rows = json.loads(Path(args.out).with_suffix(".json").read_text())  # earlier sizes
    format1_why = "skipped: needs ~72 bytes per document per rank ({:.1f} GB; above "
    format1_why += "--format1-max-docs on this shared 24 GiB machine)"
    megatron_why = (
        "skipped (above --megatron-max-docs): its index build took ~100 s at 1e7 documents "
        "here and grows with the corpus; at 1e9 its .idx (20 GB) and 3-epoch document index "
        "(~12 GB in memory) exceed this machine"
    )
    with bench_common.work_dir(args.workdir, "bench_scale_") as root:
        for num_docs in [int(float(s)) for s in args.sizes.split(",")]:
            data = root / f"docs_{num_docs}"
            split, made = bench_common.timed(synthetic_corpus, data, num_docs)
            print(
                f"\n## {num_docs:,} documents ({split}); corpus written in {made:.1f} s", flush=True
            )
            # loader: (python, the most documents it runs at, why not above)
            format1 = (args.format1_max_docs, format1_why.format(72 * num_docs / 1e9))
            plans = {
                "ours": (sys.executable, float("inf"), ""),
                "format1": (sys.executable, *format1),
            }
            if peer := args.peer_python:
                plans["megatron"] = (peer, args.megatron_max_docs, megatron_why)
                plans["olmo"] = (peer, args.olmo_max_docs, "skipped (see --olmo-max-docs)")
                if num_docs <= args.megatron_max_docs:
                    (data / "megatron").mkdir(exist_ok=True)
                    megatron_files(split, data / "megatron" / "corpus")
            for impl, (python, most, why) in plans.items():
                if num_docs > most:
                    result = {"impl": impl, "error": why}
                else:
                    result = run_child(python, impl, data, args.seconds, args.child_timeout)
                rows.append(result | {"documents": num_docs})
                print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(data)  # disk is shared: one size at a time
    write_scale_table(rows, args.out)


def write_scale_table(rows: list[dict], out: str | None) -> None:
    """The markdown table of --scale rows (also usable on the JSON lines of a partial run)."""
    names = {
        "ours": "ours (format 2)",
        "format1": "format-1 loader (previous design)",
        "megatron": "megatron-core GPTDataset",
        "olmo": "OLMo-core NumpyFSLDataset",
    }
    lines = [
        f"# Dataloader at scale ({time.strftime('%Y-%m-%d')})",
        "",
        "Command: `python scripts/bench_dataloader.py --scale --peer-python BENCHVENV/bin/python`. Rank "
        f"{SCALE_RANK} of {SCALE_WORLD}, batch {SCALE_BATCH} x seq_len {SCALE_SEQ}; synthetic corpus "
        "of documents of 500..1500 tokens (real documents.npy, sparse uint16 shards of ~1 Gi tokens). "
        f"Each cell is one fresh process. Machine: {bench_common.device_name()}, shared with other jobs; "
        f"{bench_common.versions_line(bench_common.versions(('numpy',)))}.",
        "",
        "| documents | loader | index build (once) | build | first batch | steady tokens/s | resume deep | peak RSS above interpreter |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['documents']:,} | {names[r['impl']]} | {r['error']} ||||||")
            continue
        build = (
            f"{r['index_build_s']:.2f} s ({r['index_build_rss_mb']:.0f} MB)"
            if "index_build_s" in r
            else "none"
        )
        lines.append(
            f"| {r['documents']:,} | {names[r['impl']]} | {build} | {r['build_s']:.3f} s | "
            f"{r['first_batch_s']:.3f} s | {r['tokens_per_s'] / 1e6:.1f} M | {r['resume_s']:.3f} s | "
            f"{r['peak_rss_above_interpreter_mb']:.0f} MB |"
        )
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if out:
        Path(out).write_text(text)
        Path(out).with_suffix(".json").write_text(json.dumps(rows, indent=1))


def shuffle_stats_main(args) -> None:
    """Same-document share of a global batch: format 1 (consecutive windows of a
    document-shuffled stream) vs format 2 (Feistel-shuffled windows) vs format 3 (windows
    shuffled within groups of shuffled blocks). Formats 1 and 2 are the orders a resumed
    run of that format keeps (dataloader/legacy_order.py; the same order as the loaders of
    those commits, tests/dataloader/test_loader.py)."""
    with bench_common.work_dir(args.workdir, "bench_shuffle_") as workdir:
        split = bench_common.shakespeare(workdir / "shakespeare") / "train"
        for seq_len, global_batch in ((128, 64), (256, 64), (512, 64), (2048, 64), (8192, 32)):
            shuffle_stats(split, seq_len, global_batch)


def shuffle_stats(split: Path, seq_len: int, global_batch: int) -> None:
    """One line of --shuffle-stats: the four orders at this seq_len and global batch."""
    from dataloader.legacy_order import DocumentShuffleOrder, WindowShuffleOrder
    from dataloader.stream import DatasetStream

    dataset = DatasetStream(str(split), 0, 0, max_seq_len=seq_len)
    new, old = WindowShuffleOrder(dataset, seq_len), DocumentShuffleOrder(dataset, seq_len)
    starts = np.asarray(new.stream.doc_starts)

    def docs_at(a):
        """The documents the window starting at token `a` touches (its labels too)."""
        lo = int(np.searchsorted(starts, a, "right")) - 1
        return set(range(lo, int(np.searchsorted(starts, a + seq_len + 1, "left"))))

    def docs_old(k):
        epoch, offset = divmod(k * seq_len, old.stream.num_tokens)
        order, cum = old._epoch(epoch)
        end = min(offset + seq_len + 1, old.stream.num_tokens)
        lo, hi = np.searchsorted(cum, offset, "right") - 1, np.searchsorted(cum, end, "left")
        return {int(d) for d in order[lo:hi]}  # (crossing into the next epoch: its first part)

    def docs_blocked(block_tokens, shuffle_blocks):
        """Format 3: the epoch's window starts in order (blocks, groups of blocks)."""
        config = {"block_tokens": block_tokens, "shuffle_blocks": shuffle_blocks}
        blocked = DatasetStream(str(split), 0, 0, max_seq_len=seq_len, **config)
        order: list = []
        blocked.advance(blocked.start_position(), seq_len, new.windows_per_epoch, order)
        return lambda k: docs_at(order[k][1])

    small = max(seq_len, 8192)  # a group of 16 blocks: 1/16 to 1/4 of this corpus
    orders = {
        "format 1": docs_old,
        "format 2": lambda k: docs_at(new.window_start(k)),
        "format 3": docs_blocked(1 << 17, 1024),
        "format 3 small groups": docs_blocked(small, 16),
    }
    num_batches, shares = new.windows_per_epoch // global_batch, {}
    for name, docs in orders.items():
        same = []
        for b in range(num_batches):
            sets = [docs(b * global_batch + i) for i in range(global_batch)]
            same += [bool(x & y) for x, y in itertools.combinations(sets, 2)]
        shares[name] = sum(same) / len(same)
    mean_doc = new.stream.num_tokens / new.stream.manifest.num_documents
    print(
        f"seq_len {seq_len:5d}, global batch {global_batch}, {num_batches} batches (one epoch; "
        f"mean document {mean_doc:.0f} tokens): same-document pairs in a batch "
        f"format 1 {shares['format 1']:.4%}, format 2 {shares['format 2']:.4%}, format 3 "
        f"{shares['format 3']:.4%} (default blocks: one group here), format 3 with groups of "
        f"16 x {small} tokens {shares['format 3 small groups']:.4%}"
    )


def cold_main(args) -> None:
    """Data wait per batch with cold pages: prefetch off vs on, with a simulated step."""
    from dataloader.manifest import DOCUMENTS_NAME

    with bench_common.work_dir(args.workdir, "bench_cold_") as workdir:
        # ~2 GiB of real random tokens, in 8 shards (the reader threads' files)
        split = synthetic_corpus(workdir / "cold", 1 << 20, shard_tokens=1 << 27, fill=True)
        files = [*(split / "shards").iterdir(), split / DOCUMENTS_NAME]
        batch, seq_len, steps, step_s = 16, 8192, 60, args.step_ms / 1000
        print(
            f"cold pages: {sum(f.stat().st_size for f in files) / 2**30:.1f} GiB of shards evicted "
            f"from the page cache (posix_fadvise DONTNEED) before each run; batch {batch} x "
            f"{seq_len}, {steps} steps, simulated compute {args.step_ms:.0f} ms per step"
        )
        for prefetch, threads in ((0, 1), (2, 1), (2, 4), (4, 8)):
            for trial in range(2):
                for f in files:
                    fd = os.open(f, os.O_RDONLY)
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                config = {"seed": trial, "prefetch": prefetch, "read_threads": threads}
                loader = bench_common.token_loader(split, seq_len, batch, **config)
                next(loader)  # first batch (start-up) not counted
                loader.data_wait_seconds = 0.0
                start = time.perf_counter()
                for _ in range(steps):
                    next(loader)
                    time.sleep(step_s)
                wall = time.perf_counter() - start
                loader.close()
                wait = loader.data_wait_seconds
                print(
                    f"prefetch {prefetch}, read_threads {threads} (trial {trial}): data wait "
                    f"{wait / steps * 1000:7.2f} ms/step = {wait / wall:6.1%} of wall time"
                )
        shutil.rmtree(split.parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short timings, 1,000 shards not 10k")
    parser.add_argument("--workdir", type=Path, help="keep the data here (default: a temp dir)")
    parser.add_argument("--scale", action="store_true", help="cost vs corpus size, with peers")
    parser.add_argument("--sizes", default="1e6,1e7,1e8,1e9", help="documents per corpus (--scale)")
    parser.add_argument("--peer-python", help="a venv's python with megatron-core, ai2-olmo-core")
    parser.add_argument("--format1-max-docs", type=float, default=1e8)
    parser.add_argument("--megatron-max-docs", type=float, default=1e7)
    parser.add_argument("--olmo-max-docs", type=float, default=1e9)
    parser.add_argument("--seconds", type=float, default=2.0, help="steady-state window (--scale)")
    parser.add_argument("--child-timeout", type=float, default=1800)
    parser.add_argument("--out", help="write the --scale table here (and .json beside it)")
    parser.add_argument("--append", action="store_true", help="add to the rows already in --out")
    parser.add_argument("--shuffle-stats", action="store_true", help="same-document pairs a batch")
    parser.add_argument("--cold", action="store_true", help="cold-page data wait, prefetch on/off")
    parser.add_argument("--step-ms", type=float, default=50.0, help="simulated step time (--cold)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one child measurement
    args = parser.parse_args()
    if args.measure:
        return print(json.dumps(measure_child(args.measure, args.workdir, args.seconds)))
    modes = {"scale": scale_main, "shuffle_stats": shuffle_stats_main, "cold": cold_main}
    if mode := next((m for m in modes if getattr(args, m)), None):
        return modes[mode](args)
    seconds = 1.0 if args.quick else 4.0
    with bench_common.work_dir(args.workdir, "bench_dataloader_") as workdir:
        data, took = bench_common.timed(bench_common.shakespeare, workdir / "shakespeare")
        print(f"prepared Shakespeare (tokenizer training included) in {took:.1f} s")

        print("\n## Loader throughput (1 rank, page cache)")
        ours = {}
        for seq_len in (2048, 8192):
            batches, elapsed = bench_common.rate(
                bench_common.token_loader(data / "train", seq_len).__next__, seconds
            )
            tokens = batches * 8 * seq_len / elapsed
            speed = f"{batches / elapsed:8.1f} batches/s  {tokens / 1e6:7.1f} M tokens/s"
            print(f"seq_len {seq_len} x batch 8: {speed}")
            ours[seq_len] = tokens
        stock = stock_loader_throughput(data, workdir, 2048, 8, seconds)
        print(
            f"torchtitan HuggingFaceTextDataLoader, seq_len 2048 x batch 8: {stock / 1e6:.3f} M "
            f"tokens/s -> ours is {ours[2048] / stock:.0f}x faster"
        )

        print("\n## Startup (construct + first batch, seq_len 2048 x 8)")
        for num_shards in (10, 1_000 if args.quick else 10_000):
            # one document (500..1500 tokens) per shard file
            path = synthetic_corpus(workdir / f"synthetic_{num_shards}", num_shards, shard_tokens=1)
            print(f"{num_shards:6d} shard files: {time_to_first_batch(path) * 1000:7.1f} ms")

        print("\n## Time to first batch after resume")
        path = data / "train"
        for cursor in (16, 10**12):
            took = time_to_first_batch(path, deep_state(bench_common.token_loader(path), cursor))
            print(f"cursor {cursor:>14,d} sequences: {took * 1000:7.1f} ms")

        print("\n## Prepare throughput (one core)")
        prepared, raw = prepare_throughput(data, workdir)
        print(
            f"prepare (read + encode + write + hash): {prepared / 1e6:.2f} M tokens/s; raw "
            f"encode_batch: {raw / 1e6:.2f} M tokens/s ({prepared / raw:.0%} of raw)"
        )


if __name__ == "__main__":
    main()
