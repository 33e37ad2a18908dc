"""The cross-group gradient sum (`train.replica_groups.trainer.GradientSum`) on real gloo
processes: each rank plays one group's rank 0 (torchft's group connects the same rank of
every group, its SUM is a plain all_reduce, which the test's manager issues).

- Two groups, two micro-batches each, buckets made small so that gradients go both alone
  and packed, more buckets than may be in flight: after the armed (last) backward every
  gradient is the SUM of each group's accumulated gradient times its share, bit for bit
  what a SUM of the scaled gradients gives, and the loss lane likewise; the unarmed
  micro-batch sent nothing, and a second step sums afresh.
- FSDP inside a group (two ranks, one group): the hooks see the accumulated sharded
  gradient, once per parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.utils.distributed import run_distributed_test
from train.replica_groups import trainer as replica_trainer


class _Manager:
    """torchft's `Manager.allreduce` over a plain process group (the test's groups)."""

    def __init__(self, group=None):
        self.group, self.sizes = group, []

    def allreduce(self, tensor, reduce_op):
        self.sizes.append(tensor.numel())
        return dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True)


class _Ft:
    enabled = True

    def __init__(self, group=None):
        self.manager = _Manager(group)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(4)], torch.nn.Linear(6, 2))


def _backward(model, rank: int, micro: int) -> torch.Tensor:
    torch.manual_seed(100 * rank + micro)
    loss = model(torch.randn(3, 6)).square().mean()
    loss.backward()
    return loss.detach()


def _two_groups(rank: int, world_size: int) -> None:
    # 60 bytes: the 6x6 weights (144 bytes) go alone, the rest (the biases, 24 bytes, the
    # 6x2 weight, 48, the loss) in three buckets, one more than may be in flight
    replica_trainer.REPLICA_BUCKET_BYTES = 60
    share = (rank + 1) / 3  # group 0 trained one slice of three, group 1 two
    model, reference = _model(), _model()
    ft = _Ft()
    grad_sum = replica_trainer.GradientSum(ft, list(model.parameters()))
    for step in range(2):
        model.zero_grad()
        reference.zero_grad()
        grad_sum.arm(None)
        _backward(model, rank, 2 * step)
        _backward(reference, rank, 2 * step)
        assert ft.manager.sizes == [], "an unarmed backward sent gradients"
        grad_sum.arm(share)
        loss = _backward(model, rank, 2 * step + 1)
        _backward(reference, rank, 2 * step + 1)
        summed = grad_sum.finish(loss.reshape(1))
        lane = loss.reshape(1) * share
        dist.all_reduce(lane)
        assert torch.equal(summed, lane), (summed, lane)
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            expected = r.grad * share
            dist.all_reduce(expected)
            assert torch.equal(p.grad, expected), (p.grad, expected)
        alone = [n for n in ft.manager.sizes if n == 36]
        assert len(alone) == 4 and len(ft.manager.sizes) > 6, ft.manager.sizes
        ft.manager.sizes.clear()


def test_two_groups_sum_their_scaled_gradients_in_place():
    run_distributed_test(_two_groups, 2)


def _fsdp_group(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    alone = dist.new_group([0]), dist.new_group([1])  # one group: the sum is its own
    model, reference = _model(), _model()
    for m in (model, reference):
        for layer in m:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    ft = _Ft(alone[rank])
    grad_sum = replica_trainer.GradientSum(ft, list(model.parameters()))
    grad_sum.arm(None)
    _backward(model, rank, 0)
    _backward(reference, rank, 0)
    grad_sum.arm(0.25)
    loss = _backward(model, rank, 1)
    _backward(reference, rank, 1)
    assert torch.equal(grad_sum.finish(loss.reshape(1)), loss.reshape(1) * 0.25)
    assert sum(ft.manager.sizes) == sum(p.to_local().numel() for p in model.parameters()) + 1
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad.to_local(), r.grad.to_local() * 0.25)


def test_fsdp_hooks_see_the_accumulated_shard():
    run_distributed_test(_fsdp_group, 2)
