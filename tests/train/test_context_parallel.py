"""Context parallelism on CPU keeps document masks: torchtitan's own CP path, on gloo ranks,
and the block tables FlexAttention's GPU kernel reads say the same as the mask.

torchtitan 0.3.0 applies CP to a FlexAttention model by all-gathering K and V
(`flex_cp_allgather`) and sharding the batch's `BlockMask` on its query dimension
(`cp_shard` -> torch's `_create_cp_block_mask`, whose `mask_mod` maps a local query index
and a load-balanced key index back to global ones). On CPU the model's FlexAttention is
`train.attention.DocumentMaskedSDPA`, a FlexAttention subclass, so the same path applies
and its dense mask is the sharded mask's own `mask_mod` on the (local q x global kv) grid.
On a GPU FlexAttention's kernel does not evaluate that grid: it visits the tiles its
block tables list, calling `mask_mod` on partial tiles (`kv_indices`) and skipping it on
full ones (`full_kv_indices`); its backward walks the transposed tables (`q_indices`,
`full_q_indices`). `kernel_mask` rebuilds the mask from those tables alone.

- `test_cp_attention_equals_unsharded_on_packed_documents`: on 2 sequences of the real
  loader (one packing many short documents, one inside a long scene, so partial and full
  tiles both occur), for both of torchtitan's balancers ("headtail", "ptrr"):
  - the unsharded mask and each rank's sharded one: both block-table views and the dense
    mask_mod equal the causal document mask computed from the batch's positions and the
    global index of each local query and gathered key; a table with a partial tile
    promoted to full, or a tile dropped, fails that check;
  - per rank, the tiles and attended pairs `scripts/bench_cp_balance.py` books to it
    (computed from the unsharded mask) are those of its real sharded mask;
  - the model under CP, fed the shards `prepare_context_parallel_input` makes, gives each
    rank exactly its rows of the unsharded logits, and the gradients summed over the CP
    ranks equal the unsharded gradients (fp32; rtol/atol 1e-5 and 1e-4: the two sides
    differ only in summation order).
- `test_cp_training_losses_equal_unsharded_training` (slow): the trainer end to end, cp 2
  on 2 ranks against FSDP 2 on 2 ranks (same global batch, same initial weights).
"""

from __future__ import annotations

import pytest
import torch

from tests.utils.distributed import run_distributed_test
from tests.utils.runs import REPO

SEQ_LEN = 256  # torch's CP block mask needs seq_len divisible by cp x 128
# 2 x cp x 128: headtail's 2 x cp chunks are whole 128-token mask blocks, so the benchmark's
# per-block accounting applies to both balancers
CP_SEQ_LEN = 512
BALANCERS = ("headtail", "ptrr")


def _first_sequence(data, tokenizer_dir, seq_len):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from dataloader import MixEntry, TokenShardDataLoader

    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(tokenizer_dir))
    loader = TokenShardDataLoader.Config(mix=[MixEntry(str(data / "train"))]).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=1
    )
    inputs, labels = next(iter(loader))
    return inputs["input"], inputs["positions"], labels


@pytest.fixture(scope="module")
def packed_batch(shakespeare_data, short_docs_data):
    """(tokens, positions, labels) of 2 sequences from the real loader: short documents
    packed, then a window of the plays (scenes of ~2K tokens: whole mask blocks in one)."""
    tokenizer_dir = shakespeare_data / "tokenizer"
    rows = [
        _first_sequence(d, tokenizer_dir, CP_SEQ_LEN) for d in (short_docs_data, shakespeare_data)
    ]
    return tuple(torch.cat(parts) for parts in zip(*rows, strict=True))


def test_cp_attention_equals_unsharded_on_packed_documents(packed_batch):
    tokens, positions, labels = packed_batch
    # many documents in the first sequence, some crossing the CP shard boundaries (the
    # documents are README words, so their count moves with the README: ~12-20 at 512
    # tokens); the second lies in one or two scenes
    starts = (positions == 0).sum(dim=1).tolist()
    assert starts[0] >= 8 and starts[1] <= 2, starts
    run_distributed_test(_cp_equals_unsharded, 2, tokens, positions, labels)


def document_causal_mask(positions, q_global, kv_global):
    """(batch, 1, q, kv): whether the token at global index q_global[b, i] attends to the
    one at kv_global[b, j], from the loader's positions alone (a document starts where its
    position is 0; causal within it)."""
    document = torch.cumsum(positions == 0, dim=1)
    q_doc, kv_doc = document.gather(1, q_global), document.gather(1, kv_global)
    same = q_doc.unsqueeze(2) == kv_doc.unsqueeze(1)
    return (same & (kv_global.unsqueeze(1) <= q_global.unsqueeze(2))).unsqueeze(1)


def kernel_mask(block_mask, by_key_blocks: bool = False):
    """The (batch, heads, q, kv) mask FlexAttention's kernel applies, from the block tables
    alone: per query block (the forward's `kv_*` tables) or per key block (the backward's
    `q_*` tables), a partial tile through `mask_mod`, a full tile whole, an unlisted tile
    not at all. A tile listed twice (the kernel would count it twice) fails."""
    batch, heads, q_len, kv_len = block_mask.shape
    q_block, kv_block = block_mask.BLOCK_SIZE
    side = "q" if by_key_blocks else "kv"
    tables = {
        True: (getattr(block_mask, f"{side}_num_blocks"), getattr(block_mask, f"{side}_indices")),
        False: (
            getattr(block_mask, f"full_{side}_num_blocks"),
            getattr(block_mask, f"full_{side}_indices"),
        ),
    }
    visits = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.int32)
    attended = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.bool)
    for partial, (num, indices) in tables.items():
        for b in range(batch):
            for h in range(heads):
                for row in range(num.shape[2]):
                    for col in indices[b, h, row, : num[b, h, row]].tolist():
                        qb, kb = (col, row) if by_key_blocks else (row, col)
                        q0, q1 = qb * q_block, min(q_len, (qb + 1) * q_block)
                        k0, k1 = kb * kv_block, min(kv_len, (kb + 1) * kv_block)
                        visits[b, h, q0:q1, k0:k1] += 1
                        attended[b, h, q0:q1, k0:k1] = (
                            block_mask.mask_mod(
                                torch.tensor(b),
                                torch.tensor(h),
                                torch.arange(q0, q1).unsqueeze(1),
                                torch.arange(k0, k1).unsqueeze(0),
                            )
                            if partial
                            else True
                        )
    assert int(visits.max()) <= 1, "a tile is listed twice"
    return attended


def check_block_tables(block_mask, expected) -> None:
    """The forward's and the backward's block tables, and the dense mask_mod the CPU
    attention evaluates (`train.attention.dense_mask`), each give `expected`."""
    from train.attention import dense_mask

    assert torch.equal(dense_mask(block_mask, "cpu"), expected), "mask_mod"
    assert torch.equal(kernel_mask(block_mask), expected), "kv tables (forward)"
    assert torch.equal(kernel_mask(block_mask, by_key_blocks=True), expected), "q tables"


def corrupted(block_mask, promote: bool):
    """`block_mask` with one wrong tile: a partial tile promoted to full (`promote`: its
    masked-out pairs would be attended) or the last tile of the busiest row dropped."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_num, kv_idx = block_mask.kv_num_blocks.clone(), block_mask.kv_indices.clone()
    full_num = block_mask.full_kv_num_blocks.clone()
    full_idx = block_mask.full_kv_indices.clone()
    if promote:
        b, h, row = (kv_num > 0).nonzero()[0].tolist()
        tile = kv_idx[b, h, row, kv_num[b, h, row] - 1].item()
        kv_num[b, h, row] -= 1
        full_idx[b, h, row, full_num[b, h, row]] = tile
        full_num[b, h, row] += 1
    else:
        num = full_num if int(full_num.max()) > 0 else kv_num
        b, h, row = (num == num.max()).nonzero()[0].tolist()
        num[b, h, row] -= 1
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
        seq_lengths=block_mask.seq_lengths,
    )


def _cp_equals_unsharded(rank, world_size, tokens, positions, labels):
    import copy
    import sys

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.context_parallel import (
        apply_cp_to_forward,
        cp_shard,
        prepare_context_parallel_input,
    )

    from tests.utils.tiny_model import build_model, tiny_model_config
    from train.attention import document_sdpa_cls

    sys.path.insert(0, str(REPO / "scripts"))
    from bench_cp_balance import rank_loads

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = build_model(tiny_model_config(vocab_size=2048))  # seeded: the same on each rank
    pristine = copy.deepcopy(model)
    batch, seq_len = tokens.shape
    everything = torch.arange(seq_len).expand(batch, seq_len).contiguous()

    def loss_sum(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")

    # unsharded: the whole sequences, torchtitan's causal + document block mask, whose
    # tables hold partial and full tiles
    masks = model.get_attention_masks(positions=positions)
    assert int(masks.kv_num_blocks.sum()) > 0 and int(masks.full_kv_num_blocks.sum()) > 0
    check_block_tables(masks, document_causal_mask(positions, everything, everything))
    logits = model(tokens, positions=positions, attention_masks=masks)
    loss_sum(logits, labels).backward()

    for balancer in BALANCERS:
        # CP as torchtitan's trainer applies it (parallelize_llama, post_dataloading_process)
        cp_model = copy.deepcopy(pristine)
        inner = [block.attention.inner_attention for block in cp_model.layers.values()]
        assert all(isinstance(m, document_sdpa_cls()) for m in inner)
        apply_cp_to_forward(inner, mesh)
        extra = {"positions": positions, "attention_masks": masks}
        cp_tokens, cp_labels, extra = prepare_context_parallel_input(
            tokens, labels, extra, mesh, torch.device("cpu"), balancer
        )
        sharded = extra["attention_masks"]
        local = seq_len // world_size
        assert sharded.shape == (batch, 1, local, seq_len), balancer  # local q x global kv

        # the global token of each local query, and of each gathered key (the ranks' shards
        # in rank order, as flex_cp_allgather gathers K and V)
        (q_global,), _ = cp_shard(mesh, (everything,), masks, balancer)
        gathered = [torch.empty_like(q_global) for _ in range(world_size)]
        dist.all_gather(gathered, q_global)
        expected = document_causal_mask(positions, q_global, torch.cat(gathered, dim=1))
        check_block_tables(sharded, expected)
        for promote in (True, False):
            with pytest.raises(AssertionError, match="tables"):
                check_block_tables(corrupted(sharded, promote), expected)

        # what the benchmark books to this rank is what its sharded mask holds
        loads = rank_loads(masks, balancer, world_size)
        tiles = sharded.kv_num_blocks.sum() + sharded.full_kv_num_blocks.sum()
        assert loads["tiles"][rank] == int(tiles), balancer
        assert loads["pairs"][rank] == int(expected.sum()), balancer

        cp_logits = cp_model(cp_tokens, **extra)
        loss_sum(cp_logits, cp_labels).backward()
        # this rank's rows of the unsharded logits: the same load-balanced shard of them
        (expected_logits,), _ = cp_shard(mesh, (logits.detach(),), masks, balancer)
        torch.testing.assert_close(cp_logits, expected_logits, rtol=1e-5, atol=1e-5)
        for (name, p), cp_p in zip(model.named_parameters(), cp_model.parameters(), strict=True):
            grad = cp_p.grad.clone()
            dist.all_reduce(grad)  # each CP rank holds its tokens' share of the gradient
            torch.testing.assert_close(grad, p.grad, rtol=1e-4, atol=1e-5, msg=f"{balancer} {name}")


@pytest.mark.slow
def test_cp_training_losses_equal_unsharded_training(shakespeare_data, short_docs_data, tmp_path):
    """Per-step losses of cp 2 equal those of FSDP 2 on the same packed documents.

    The baseline has 2 ranks too: both shard the parameters over 2 ranks, so both start
    from the same weights (a 1-rank run initialises other weights on CPU). Same global
    batch (2 sequences: one per rank, or both on each CP rank, half the tokens each), fp32
    (FP8 scales depend on which tokens a rank holds). What differs is the order of sums
    (attention over gathered K/V, the loss over ranks): measured 1.2e-7 relative on the
    loss and below 1e-7 on the gradient norm over these steps. Allowed: 1e-5 and 1e-4, far
    above fp32 reordering on any CPU, and far below what attention across documents does
    here (measured by dropping the baseline's document mask: loss 9e-5, gradient norm
    3.3e-3 relative).
    """
    from tests.utils.runs import check_ok, read_metrics, run_config, torchrun, write_config
    from tests.utils.tiny_model import TINY_TRAIN_MODEL

    sections = {
        "dataloader": {
            "tokenizer": str(shakespeare_data / "tokenizer"),
            "mix": [{"path": str(short_docs_data / "train"), "weight": 1.0}],
        },
        "model": TINY_TRAIN_MODEL,
        "fp8": {"enable": False},
        "validation": {"enable": False},
        "training": {"steps": 3, "seq_len": SEQ_LEN, "global_batch_size": 2},
        "checkpoint": {"enable": False},
    }
    losses, grad_norms = {}, {}
    for name, parallelism, local_batch in (("cp", {"cp": 2}, 2), ("fsdp", {}, 1)):
        run_dir = tmp_path / name
        layout = {"parallelism": parallelism, "training": {"local_batch_size": local_batch}}
        config = write_config(
            tmp_path / f"{name}.toml", run_config(None, run_dir, sections, layout)
        )
        check_ok(torchrun(config, 2, timeout=600))
        rows = read_metrics(run_dir, "train")
        losses[name] = [r["loss"] for r in rows]
        grad_norms[name] = [r["grad_norm"] for r in rows]
        assert [r["tokens_seen"] for r in rows] == [2 * SEQ_LEN * s for s in (1, 2, 3)]
    assert len(losses["cp"]) == 3
    torch.testing.assert_close(losses["cp"], losses["fsdp"], rtol=1e-5, atol=0)
    torch.testing.assert_close(grad_norms["cp"], grad_norms["fsdp"], rtol=1e-4, atol=0)
