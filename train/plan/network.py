"""The network between nodes, per node, and the time of a collective over it.

Why per node and not per GPU: an H100 node carries 8 NICs of 400 Gb/s (NDR InfiniBand,
RoCE), or 3,200 Gb/s of EFA on AWS p5, or one Ethernet port on a modest cluster. What a
collective that spans nodes gets is the node's share: NCCL runs one ring per channel, and
every ring leaves each node once, so a group with `m` of its ranks on each of `g` GPUs per
node drives the node's NICs for its `m / g` share while the other TP ranks of the node run
the same collective beside it (SPMD). A group of every GPU of each node (FSDP over 8 ranks
a node) gets the whole node's bandwidth, 400 GB/s on NDR; a group of one GPU a node (FSDP
beside TP 8) gets one NIC, 50 GB/s. The planner's former model, one adapter's bandwidth
for any group that crossed nodes, was the second case for every group: it predicted the
same tokens/s for two 32-GPU runs that differ only in the FP8 all-gather (issue 35).

How a collective is timed (`collective_terms`), per call of `nbytes / calls` bytes:
- **Bandwidth.** A ring all-gather or reduce-scatter moves (n-1)/n of the buffer through
  every rank (twice for an all-reduce, the whole buffer for a broadcast). Inside a node that
  crosses the GPU's scale-up link (NVLink, Infinity Fabric); across nodes the node's NICs at
  the group's share; the slower of the two bounds the pipelined ring. Both at the fitted
  `link_efficiency` of the link's peak, and the network also at its transport's share
  (`Network.transport_share`: 1 for RDMA, below for EFA and TCP, each a stated assumption).
- **Latency.** A ring pass takes n-1 steps per call, one into each node over the network
  and the rest inside nodes (an all-reduce two passes); NCCL's tree (all-reduce only) 2 log2
  hops between nodes and 2 log2 inside one. An all-reduce takes the faster of the two (NCCL's
  tuner picks the tree for the small reductions: loss, gradient norm, FP8 amax).
  A step inside a node costs `SCALE_UP_LATENCY_S`; between nodes the preset's
  `hop_latency_s`, doubled where placement is not rail-optimized (a cross-rail hop climbs
  to the spine and back: twice the switches).

The presets (`NETWORKS`) are named with their source; `--network` picks one, the GPU's
`default_network` otherwise, and the plan prints which it assumed.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

GBIT = 1e9 / 8  # bytes/s per Gb/s

# A ring step or tree hop over the scale-up link (NVLink, Infinity Fabric): an assumption of
# the order NCCL's own tuning model gives a low-latency step inside a node
SCALE_UP_LATENCY_S = 2e-6


@dataclass(frozen=True)
class Network:
    """The NICs of one node and the fabric between nodes."""

    name: str
    nics_per_node: int
    nic_gbps: float  # line rate per NIC, each direction
    rail_optimized: bool  # NIC i of every node on one leaf switch (rail i)
    transport: str  # "rdma" (InfiniBand, RoCE), "efa" (AWS SRD), "tcp" (NCCL sockets)
    hop_latency_s: float  # one step between nodes on the same rail
    transport_share: float  # achieved / RDMA's achieved bandwidth on the same line rate
    source: str

    @property
    def node_bandwidth(self) -> float:
        """Bytes/s each direction out of one node, all its NICs together."""
        return self.nics_per_node * self.nic_gbps * GBIT

    def describe(self) -> str:
        placement = "rail-optimized" if self.rail_optimized else "not rail-optimized"
        return (
            f"{self.name}: {self.nics_per_node} x {self.nic_gbps:g} Gb/s {self.transport.upper()} "
            f"per node ({self.node_bandwidth / 1e9:,.0f} GB/s), {placement}"
        )


# Each RDMA preset is at the fitted link efficiency (transport_share 1); EFA and TCP reach
# less of their line rate for NCCL's large rings: stated assumptions, no published row pins
# them (docs/dry_run.md, "The network").
NETWORKS: dict[str, Network] = {
    "ndr-ib": Network(
        "ndr-ib", 8, 400, True, "rdma", 5e-6, 1.0,
        "NVIDIA DGX H100/B200 reference architecture: 8 ConnectX-7 NDR 400 Gb/s "
        "InfiniBand, one per GPU, rail-optimized",
    ),
    "hdr-ib": Network(
        "hdr-ib", 8, 200, True, "rdma", 5e-6, 1.0,
        "NVIDIA DGX A100: 8 ConnectX-6 HDR 200 Gb/s InfiniBand, one per GPU",
    ),
    "roce": Network(
        "roce", 8, 400, True, "rdma", 7e-6, 1.0,
        "RoCE v2, 8 x 400 Gb/s a node, one per GPU: Meta's Grand Teton H100 hosts of "
        "torchtitan's benchmarks ('400 Gb/s per GPU'), AMD's MI300X/MI325X/MI355X platforms",
    ),
    "aws-p5-efa": Network(
        "aws-p5-efa", 32, 100, False, "efa", 15e-6, 0.9,
        "AWS p5.48xlarge: 3,200 Gb/s of EFA (v2) per instance, 32 adapters of 100 Gb/s; "
        "EFA's share of RDMA's achieved bandwidth 0.9 (assumed)",
    ),
    "ethernet": Network(
        "ethernet", 1, 100, False, "tcp", 30e-6, 0.6,
        "one 100 Gb/s Ethernet port per node, NCCL over TCP sockets; TCP's share of RDMA's "
        "achieved bandwidth 0.6 (assumed)",
    ),
}  # fmt: skip


def network(name: str) -> Network:
    """The preset `--network name`, or a ValueError naming the choices."""
    if name not in NETWORKS:
        raise ValueError(f"--network {name!r} is not known; choose one of {', '.join(NETWORKS)}")
    return NETWORKS[name]


def placement(ranks: list[int], gpus_per_node: int) -> tuple[int, int]:
    """(nodes the group spans, its ranks on the busiest node)."""
    per_node = Counter(r // gpus_per_node for r in ranks)
    return len(per_node), max(per_node.values())


def collective_terms(
    gpu, net: Network, ranks: list[int], kind: str, nbytes: int, calls: int
) -> tuple[float, float]:
    """(seconds of bandwidth at a link efficiency of 1, seconds of latency) of `calls`
    collectives of `kind` moving `nbytes` in all over `ranks` (module doc); `gpu` is a
    `train.plan.gpu_specs.GpuSpec`. The time is bandwidth / link_efficiency + latency."""
    n = len(ranks)
    if n <= 1:
        return 0.0, 0.0
    g = gpu.gpus_per_node
    nodes, m = placement(ranks, g)
    reduce = kind.startswith("all-reduce")
    share = 1.0 if kind.startswith("broadcast") else (n - 1) / n * (2 if reduce else 1)
    moved = share * nbytes
    bandwidth = moved / gpu.scale_up_bandwidth
    passes = 2 if reduce else 1  # a ring all-reduce: reduce-scatter, then all-gather
    if nodes > 1:
        group_share = net.node_bandwidth * min(1.0, m / g)
        bandwidth = max(bandwidth, moved / (group_share * net.transport_share))
        hop = net.hop_latency_s * (1 if net.rail_optimized else 2)
        # a ring pass: one step into each node over the network, the rest inside nodes
        ring = passes * (nodes * hop + (n - nodes) * SCALE_UP_LATENCY_S)
        tree = 2 * math.ceil(math.log2(nodes)) * hop
        tree += 2 * math.ceil(math.log2(m)) * SCALE_UP_LATENCY_S if m > 1 else 0.0
    else:
        ring = passes * (n - 1) * SCALE_UP_LATENCY_S
        tree = 2 * math.ceil(math.log2(n)) * SCALE_UP_LATENCY_S
    latency = min(ring, tree) if reduce else ring
    return bandwidth, calls * latency
