"""Context parallelism on CPU keeps document masks: torchtitan's own CP path, on gloo ranks.

torchtitan 0.3.0 applies CP to a FlexAttention model by all-gathering K and V
(`flex_cp_allgather`) and sharding the batch's `BlockMask` on its query dimension
(`cp_shard` -> torch's `_create_cp_block_mask`, whose `mask_mod` maps a local query index
and a load-balanced key index back to global ones). On CPU the model's FlexAttention is
`train.attention.DocumentMaskedSDPA`, a FlexAttention subclass, so the same path applies
and its dense mask is the sharded mask's own `mask_mod` on the (local q x global kv) grid.

- `test_cp_attention_equals_unsharded_on_packed_documents`: the model under CP, fed the
  shards `prepare_context_parallel_input` makes (headtail load balancing, torchtitan's
  default), gives each rank exactly its rows of the unsharded logits, and the gradients
  summed over the CP ranks equal the unsharded gradients, on sequences packing many
  documents (fp32; rtol/atol 1e-5 and 1e-4: the two sides differ only in summation order).
- `test_cp_training_losses_equal_unsharded_training` (slow): the trainer end to end, cp 2
  on 2 ranks against FSDP 2 on 2 ranks (same global batch, same initial weights).
"""

from __future__ import annotations

import pytest
import torch

from tests.utils.distributed import run_distributed_test

SEQ_LEN = 256  # torch's CP block mask needs seq_len divisible by cp x 128


@pytest.fixture(scope="module")
def packed_batch(shakespeare_data, short_docs_data):
    """(tokens, positions) of 2 sequences from the real loader over short documents."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from dataloader import MixEntry, TokenShardDataLoader

    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(shakespeare_data / "tokenizer"))
    loader = TokenShardDataLoader.Config(mix=[MixEntry(str(short_docs_data / "train"))]).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=2
    )
    inputs, labels = next(iter(loader))
    return inputs["input"], inputs["positions"], labels


def test_cp_attention_equals_unsharded_on_packed_documents(packed_batch):
    tokens, positions, labels = packed_batch
    # several documents in each sequence, some crossing the CP shard boundaries (the
    # documents are README words, so their count moves with the README: 6-10 at 256 tokens)
    assert ((positions[:, 1:] == 0).sum(dim=1) >= 4).all()
    run_distributed_test(_cp_equals_unsharded, 2, tokens, positions, labels)


def _cp_equals_unsharded(rank, world_size, tokens, positions, labels):
    import copy

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

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = build_model(tiny_model_config(vocab_size=2048))  # seeded: the same on each rank
    cp_model = copy.deepcopy(model)

    def loss_sum(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")

    # unsharded: the whole sequences, torchtitan's causal + document block mask
    masks = model.get_attention_masks(positions=positions)
    logits = model(tokens, positions=positions, attention_masks=masks)
    loss_sum(logits, labels).backward()

    # CP as torchtitan's trainer applies it (parallelize_llama, post_dataloading_process)
    inner = [block.attention.inner_attention for block in cp_model.layers.values()]
    assert all(isinstance(m, document_sdpa_cls()) for m in inner)
    apply_cp_to_forward(inner, mesh)
    extra = {"positions": positions, "attention_masks": masks}
    cp_tokens, cp_labels, extra = prepare_context_parallel_input(
        tokens, labels, extra, mesh, torch.device("cpu"), "headtail"
    )
    local = SEQ_LEN // world_size
    assert extra["attention_masks"].shape == (2, 1, local, SEQ_LEN)  # local q x global kv
    cp_logits = cp_model(cp_tokens, **extra)
    loss_sum(cp_logits, cp_labels).backward()

    # this rank's rows of the unsharded logits: the same load-balanced shard of them
    (expected,), _ = cp_shard(mesh, (logits.detach(),), None, "headtail")
    torch.testing.assert_close(cp_logits, expected, rtol=1e-5, atol=1e-5)
    for (name, p), cp_p in zip(model.named_parameters(), cp_model.parameters(), strict=True):
        grad = cp_p.grad.clone()
        dist.all_reduce(grad)  # each CP rank holds its tokens' share of the gradient
        torch.testing.assert_close(grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


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
