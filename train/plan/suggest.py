"""Suggest a layout: every (dp_shard, tp, cp, AC mode, local batch) the launch rules admit
for a model on N GPUs, ranked by predicted tokens/s/GPU, those that fit first.

Why: the layout of a run (how many ways to shard, split tensors, split the sequence, what to
recompute, how many sequences per micro-batch) is chosen before any GPU is had, and the
plan (`train.plan.dry_run.plan`) answers for one layout in about half a minute on two cores.
A sweep of the 50-100 layouts that 8 or 64 GPUs admit would take an hour that way. So the
suggestion traces few steps and scales them:

- **Candidates.** tp in the divisors of the world size up to a node's GPUs (TP across nodes
  runs its per-layer collectives over the network: never a good layout), cp in the divisors
  of the rest, dp_shard the remainder, AC in none / selective / full, local batch in the
  divisors of global / dp_shard. Each is put through `train.launch_rules.check_launch`, the
  rules a launch runs (heads divisible by tp, seq_len by the CP blocks, the batch by the
  data-parallel degree); what they refuse is counted, not listed. dp_replicate stays 1
  (FSDP only: HSDP is not explored).
- **Traces.** One step per AC mode (2 and 3 layers extended to all, as
  `train.plan.trace.measure` does) at one reference layout: the smallest tp > 1 and cp > 1
  among the candidates (so the TP and CP collectives are in the trace), local batch 2
  where admitted (else 1): the estimate interpolates between it and its doubled trace
  for most layouts, and extrapolating from local batch 1 underestimated memory by up to
  36 % at local batch 4 (8B on 8 GPUs, against full plans).
- **Scaling** (per rank, per micro-batch; rho = local tokens per rank against the
  reference's, b x seq / cp; theta = reference tp / tp):
  GEMM FLOPs x rho x theta; attention FLOPs x b x theta x
  cp_ref / cp (a rank's queries against the whole sequence); TP collectives x rho (the
  gathered activations are the rank's tokens x dim whatever tp); CP's K/V exchange x b x
  theta (the whole sequence's K and V, KV heads split by tp); FSDP's gathers and
  reductions x theta (a layer's weights / tp); what runs once per step (clipping, the
  optimizer) and the sharded states unchanged (they shard over all ranks whatever the
  split). Each reference is traced once more at 3 layers and twice the local batch, and at
  tp 1 (`token_split`), to split the memory-bound bytes into three shares: the weights'
  (x theta), the activations TP gathers (x rho), the rest (x rho x theta); and the
  activations (the forward/backward peak less parameters and gradients) into the bytes
  that do not grow with tokens (FSDP's units and buffers, x theta) and the rest
  (x rho x theta).
  Rank 0's groups are rebuilt for the candidate's mesh (torchtitan's order: dp_shard, cp,
  tp innermost), so each collective runs over the right link.
- **Judged** as the plan judges: `train.plan.time_model.predict`, `reserved_bytes`, and the
  report's verdict (`DryRunReport.verdict`: FITS, TIGHT, DOES NOT FIT), on the scaled counts.
- **Ranked** by the point estimate of tokens/s/GPU, the layouts that FIT first, then the
  TIGHT ones (their point fits, the upper end of their memory range does not); a layout
  whose tokens/s range (the held-out error, `train.plan.time_model.HELD_OUT_TOKENS_PER_S`)
  overlaps the first's is flagged "~": the model cannot tell them apart.
- **Vendors compared.** `--gpu h100,mi300x,...` ranks the same candidates on each GPU kind
  (the traced references do not depend on the GPU: traced once), prints the first kind's
  ranking, then per kind its best layout's tokens/s/GPU and memory headroom, and the
  config's own layout.

What the approximation costs is stated in docs/dry_run.md ("Suggest a layout") and held by
tests/train/plan/test_plan_suggest.py: for a few layouts of a shrunk model, the suggestion's
tokens/s and reserved memory against the full plan of that layout. A seq_len schedule is
judged at its longest phase, as the plan's step is; run the full plan on the pick.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from train.config import ConfigError
from train.launch_rules import check_launch, divisors
from train.plan.gpu_specs import gpu_spec
from train.plan.network import network as network_preset
from train.plan.report import DryRunReport
from train.plan.step_counts import GIB, OpCounts, StepCounts
from train.plan.time_model import HELD_OUT_TOKENS_PER_S, TimeConstants, held_out_range
from train.plan.trace import TRACED_LAYERS, trace_step, traced_config

AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    """One layout: FSDP over dp_shard ranks, TP and CP degrees, AC mode, sequences per
    data-parallel rank per micro-batch."""

    dp_shard: int
    tp: int
    cp: int
    ac: str
    local_batch: int

    def overrides(self) -> str:
        """The command-line overrides that set this layout on a config."""
        return (
            f"--parallelism.dp_shard -1 --parallelism.tp {self.tp} --parallelism.cp {self.cp} "
            f"--activation_checkpoint.mode {self.ac} --training.local_batch_size {self.local_batch}"
        )

    def short(self) -> str:
        parts = [f"FSDP {self.dp_shard}"] + [f"TP {self.tp}"] * (self.tp > 1)
        parts += [f"CP {self.cp}"] * (self.cp > 1)
        return " x ".join(parts) + f", AC {self.ac}, local {self.local_batch}"


def apply(run: Any, candidate: Candidate) -> Any:
    """`run` with `candidate`'s layout (a copy; dp_shard as the rest of the world)."""
    run = copy.deepcopy(run)
    run.parallelism.dp_replicate = 1
    run.parallelism.dp_shard = -1
    run.parallelism.tp, run.parallelism.cp = candidate.tp, candidate.cp
    run.activation_checkpoint.mode = candidate.ac
    run.training.local_batch_size = candidate.local_batch
    return run


def global_batch(run: Any, world_size: int) -> int:
    """Sequences per optimizer step: the config's, or (-1) its local batch x its own
    data-parallel degree at this world size."""
    t = run.training
    if t.global_batch_size > 0:
        return t.global_batch_size
    degrees = check_launch(run, world_size)
    return t.local_batch_size * degrees["dp_replicate"] * degrees["dp_shard"]


def candidates(run: Any, world_size: int, gpus_per_node: int) -> tuple[list[Candidate], int]:
    """Every layout the launch rules admit for `run` on `world_size` GPUs, and how many
    they refused (module doc)."""
    glob = global_batch(run, world_size)
    run = copy.deepcopy(run)
    run.training.global_batch_size = glob
    admitted, refused = [], 0
    for tp in (d for d in divisors(world_size) if d <= gpus_per_node):
        for cp in divisors(world_size // tp):
            dp_shard = world_size // (tp * cp)
            for local in divisors(max(1, glob // dp_shard)) if glob % dp_shard == 0 else [1]:
                for ac in AC_MODES:
                    candidate = Candidate(dp_shard, tp, cp, ac, local)
                    if _admitted(run, candidate, world_size):
                        admitted.append(candidate)
                    else:
                        refused += 1
    return admitted, refused


def reference(admitted: list[Candidate]) -> tuple[int, int]:
    """(tp, cp) of the traced layout: the smallest degrees > 1 among the candidates, so
    that both kinds of collective are traced (1 where no candidate splits)."""
    tps = sorted({c.tp for c in admitted if c.tp > 1}) or [1]
    cps = sorted({c.cp for c in admitted if c.cp > 1 and (c.tp == tps[0] or tps == [1])})
    return tps[0], (cps or [1])[0]


# --------------------------------------------------------------------------- scaling


@dataclass
class Traced:
    """One reference step (an AC mode), and the split of its memory-bound traffic
    (`token_split`)."""

    candidate: Candidate
    counts: StepCounts  # extended to every layer
    elapsed_s: float
    shallow: StepCounts | None = None  # the 3-layer trace, for `token_split`
    doubled: StepCounts | None = None  # the same at twice the local batch (AC none's)
    fixed_shallow: StepCounts | None = None  # the 3-layer trace `doubled` doubles
    split: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)

    @property
    def fixed_activations(self) -> int:
        """The activations' bytes that do not grow with tokens (FSDP's gathered units and
        buffers), from the 3-layer traces at the local batch and twice it: held whatever
        the depth."""
        if self.doubled is None:
            return 0
        one, two = _activations(self.fixed_shallow or self.shallow), _activations(self.doubled)
        return max(0, min(2 * one - two, one))


def _at(run: Any, candidate: Candidate, world_size: int, layers: int, memory: bool) -> StepCounts:
    shallow = traced_config(apply(run, candidate))
    shallow.model.n_layers = layers
    return trace_step(shallow, world_size, accelerator=True, track_memory=memory)


def trace_reference(run: Any, candidate: Candidate, world_size: int, double: bool) -> Traced:
    """`train.plan.trace.measure`'s two traces at 2 and 3 layers, extended to every layer,
    and (`double`) the 3-layer one again at twice the local batch (what grows with
    tokens)."""
    start = time.perf_counter()
    layers = min(run.model.n_layers, TRACED_LAYERS)
    more = _at(run, candidate, world_size, layers, True)
    counts = more  # shallow models are traced whole
    if run.model.n_layers > TRACED_LAYERS:
        fewer = _at(run, candidate, world_size, TRACED_LAYERS - 1, True)
        counts = more.extend(fewer, run.model.n_layers)
    doubled_layout = dataclasses.replace(candidate, local_batch=2 * candidate.local_batch)
    doubled = (
        _at(run, doubled_layout, world_size, layers, True)
        if double and _admitted(run, doubled_layout, world_size)
        else None
    )
    return Traced(candidate, counts, time.perf_counter() - start, more, doubled)


def _admitted(run: Any, candidate: Candidate, world_size: int) -> bool:
    try:
        check_launch(apply(run, candidate), world_size)
    except ConfigError:
        return False
    return True


def _shares(at_ref: float, doubled: float | None, unsplit: float | None, tp: int) -> tuple:
    """(weights, gathered, split) shares of a count at the reference: what stays with the
    layer's weights / tp, what grows with tokens only (TP's gathered activations), what
    with tokens / tp; from the count at twice the local batch (`doubled`) and at tp 1
    (`unsplit`) where those were traced."""
    if at_ref <= 0:
        return (0.0, 0.0, 1.0)
    tokens = doubled - at_ref if doubled is not None else at_ref
    weights = min(max(0.0, at_ref - tokens), at_ref)
    tokens = at_ref - weights
    split = tokens
    if unsplit is not None and tp > 1:  # x(tp 1) = weights x tp + gathered + split x tp
        split = min(max(0.0, (unsplit - weights * tp - tokens) / (tp - 1)), tokens)
    return (weights / at_ref, (tokens - split) / at_ref, split / at_ref)


def token_split(run: Any, traced: Traced, world_size: int) -> dict[str, tuple]:
    """For each class of memory-bound bytes, the shares (weights, gathered, split) of the
    reference's count: weights' traffic (FSDP's copies, FP8 casts of weights) goes with
    the layer's weights / tp and not with tokens; the activations TP gathers (a colwise
    linear's input, its FP8 cast) with tokens only; the rest with tokens / tp. From the
    reference's 3-layer traces at its local batch and twice it, and one more at tp 1 (AC
    none; the shares are applied to every AC mode)."""
    ref = traced.candidate
    layers = min(run.model.n_layers, TRACED_LAYERS)
    unsplit_layout = dataclasses.replace(ref, tp=1, dp_shard=ref.dp_shard * ref.tp)
    unsplit = (
        _at(run, unsplit_layout, world_size, layers, False).micro.memory_bytes
        if ref.tp > 1 and _admitted(run, unsplit_layout, world_size)
        else {}
    )
    doubled = traced.doubled.micro.memory_bytes if traced.doubled else {}
    return {
        key: _shares(value, doubled.get(key), unsplit.get(key), ref.tp)
        for key, value in traced.shallow.micro.memory_bytes.items()
    }


def _activations(c: StepCounts) -> int:
    return c.peak_forward_backward - c.parameters - c.gradients


def _groups(candidate: Candidate, world_size: int, reference: dict) -> dict[str, list[int]]:
    """Rank 0's group per mesh dimension for the candidate (torchtitan's mesh order:
    dp_shard, cp, tp innermost; dp_replicate 1)."""
    tp, cp, dp = candidate.tp, candidate.cp, candidate.dp_shard
    ranks = {
        "tp": list(range(tp)),
        "cp": [i * tp for i in range(cp)],
        "fsdp": [i * tp for i in range(dp * cp)],
        "loss": [i * tp for i in range(dp * cp)],
        "dp_shard": [i * tp * cp for i in range(dp)],
        "batch": [i * tp * cp for i in range(dp)],
        "dp_replicate": [0],
        "world": list(range(world_size)),
    }
    return {dim: ranks.get(dim, group) for dim, group in reference.items()}


def _scaled_ops(
    ops: OpCounts, rho: float, theta: float, kv: float, split: dict[str, tuple]
) -> OpCounts:
    """One micro-batch's counts at the candidate (module doc)."""

    def traffic(key: str, value: int) -> int:
        weights, gathered, tokens = split.get(key, (0.0, 0.0, 1.0))
        return int(value * (weights * theta + gathered * rho + tokens * rho * theta))

    by_mesh = {"tp": rho, "cp": kv, "fsdp": theta, "dp_shard": theta}
    return OpCounts(
        # attention: `scale` sets it (a rank's queries against the whole sequence)
        flops={k: int(v * rho * theta) for k, v in ops.flops.items() if k != "attention"},
        memory_bytes={k: traffic(k, v) for k, v in ops.memory_bytes.items()},
        comm={k: int(v * by_mesh.get(k.split(" ", 1)[0], 1.0)) for k, v in ops.comm.items()},
        comm_calls=dict(ops.comm_calls),
    )


def scale(traced: Traced, candidate: Candidate, glob: int, world_size: int) -> StepCounts:
    """The reference's counts carried to `candidate` (module doc)."""
    ref, counts = traced.candidate, traced.counts
    rho = (candidate.local_batch / candidate.cp) / (ref.local_batch / ref.cp)
    theta = ref.tp / candidate.tp
    kv = candidate.local_batch / ref.local_batch * theta
    micro = _scaled_ops(counts.micro, rho, theta, kv, traced.split)
    if "attention" in counts.micro.flops:  # a rank's queries against the whole sequence
        micro.flops["attention"] = int(counts.micro.flops["attention"] * kv * ref.cp / candidate.cp)
    states = counts.parameters + counts.gradients
    fixed = min(traced.fixed_activations, _activations(counts))
    activations = int(fixed * theta + (_activations(counts) - fixed) * rho * theta)
    accumulation = glob // (candidate.local_batch * candidate.dp_shard)
    return dataclasses.replace(
        counts,
        accumulation=accumulation,
        groups=_groups(candidate, world_size, counts.groups),
        peak_forward_backward=states + activations,
        micro=micro,
    )


# --------------------------------------------------------------------------- the ranking


@dataclass
class Suggestion:
    candidate: Candidate
    report: Any  # train.plan.report.DryRunReport, on the scaled counts

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.report.prediction.tokens_per_s_per_gpu


@dataclass
class SuggestResult:
    world_size: int
    gpu_kind: str  # the --gpu key
    gpu: Any  # train.plan.gpu_specs.GpuSpec
    seq_len: int
    global_batch_size: int
    num_params: int
    ranked: list[Suggestion]  # fitting first, each group by predicted tokens/s/GPU
    refused: int  # layouts the launch rules refused
    references: list[Traced]
    own: Candidate | None  # the config's own layout, when admitted
    elapsed_s: float

    network: Any = None  # train.plan.network.Network

    def own_suggestion(self) -> tuple[int, Suggestion] | None:
        """(rank, suggestion) of the config's own layout, where admitted."""
        if self.own is None:
            return None
        return next((i, s) for i, s in enumerate(self.ranked) if s.candidate == self.own)

    @property
    def fitting(self) -> list[Suggestion]:
        """The layouts whose point estimate fits, FITS before TIGHT, each best first."""
        return [s for s in self.ranked if s.report.runs]

    def within_error_of_first(self, suggestion: Suggestion) -> bool:
        """Whether `suggestion`'s tokens/s range overlaps the first fitting layout's."""
        if not self.fitting:
            return False
        error = HELD_OUT_TOKENS_PER_S[self.gpu.vendor]
        best = held_out_range(self.fitting[0].tokens_per_s_per_gpu, error)
        mine = held_out_range(suggestion.tokens_per_s_per_gpu, error)
        return mine[1] >= best[0]


def judge(
    run: Any,
    traced: Traced,
    candidate: Candidate,
    world_size: int,
    spec: Any,
    glob: int,
    network: Any,
) -> Suggestion:
    """The plan's verdict and time for `candidate`, on the scaled reference counts, over
    `network` (a `train.plan.network.Network`)."""
    counts = scale(traced, candidate, glob, world_size)
    degrees = {"dp_replicate": 1, "dp_shard": candidate.dp_shard, "tp": candidate.tp,
               "cp": candidate.cp}  # fmt: skip
    layout = apply(run, candidate)
    report = DryRunReport.of(
        layout, counts, world_size, degrees, spec, run_seq_len(run), network, TimeConstants()
    )
    assert report.global_batch_size == glob, (report, glob)  # `run` holds it (suggest's copy)
    return Suggestion(candidate, report)


def _trace_references(
    run: Any, modes: list[str], reference: Candidate, world_size: int
) -> dict[str, Traced]:
    """One traced step per AC mode at the reference layout, AC none's first: its doubled
    trace splits what grows with tokens from what does not, which is the layout's, not the
    AC mode's (measured: the same bytes for all three modes)."""
    references = {
        ac: trace_reference(run, dataclasses.replace(reference, ac=ac), world_size, i == 0)
        for i, ac in enumerate(modes)
    }
    first = references[modes[0]]
    split = token_split(run, first, world_size)
    for traced in references.values():
        traced.split, traced.doubled = split, first.doubled
        traced.fixed_shallow = first.shallow
    return references


def run_seq_len(run: Any) -> int:
    """The seq_len the plan's step runs at: the longest of the run's phases."""
    from dataloader.global_order import longest_seq_len

    return longest_seq_len(run.training.seq_len, run.dataloader.schedule)


def suggest(
    run: Any, world_size: int, gpu: str, cache: dict | None = None, network: str | None = None
) -> SuggestResult:
    """Rank every admitted layout of `run` on `world_size` x `gpu` over `network` (a preset
    name; the GPU's default when None) (module doc).

    `cache`: a dict the caller keeps for runs that trace alike (the same model, world
    size, seq_len, batch and FP8 settings; compile, async TP, the GPU and the network only
    time the step): the traced references are reused from it."""
    start = time.perf_counter()
    spec = gpu_spec(gpu, run)
    net = network_preset(network or spec.default_network or "ndr-ib")
    if not spec.timed:
        raise ValueError(f"--suggest ranks by predicted time: --gpu {gpu} has no peaks to time")
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    glob = global_batch(run, world_size)
    admitted, refused = candidates(run, world_size, spec.gpus_per_node)
    if not admitted:
        raise ValueError(
            f"no layout of {world_size} GPUs passes the launch rules for this model, seq_len "
            f"and global batch {glob} ({refused} refused); change --world-size or "
            "training.global_batch_size"
        )
    tp, cp = reference(admitted)
    dp_shard = world_size // (tp * cp)
    # local batch 2 where admitted: most layouts then lie between it and its doubled trace
    local = 2 if any((c.tp, c.cp, c.local_batch) == (tp, cp, 2) for c in admitted) else 1
    fixed = copy.deepcopy(run)
    fixed.training.global_batch_size = glob
    modes = sorted({c.ac for c in admitted}, key=lambda ac: ac != "none")
    cache = {} if cache is None else cache
    if "references" not in cache:
        reference_layout = Candidate(dp_shard, tp, cp, modes[0], local)
        cache["references"] = _trace_references(fixed, modes, reference_layout, world_size)
    references = cache["references"]
    ranked = [judge(fixed, references[c.ac], c, world_size, spec, glob, net) for c in admitted]
    order = {"FITS": 0, "TIGHT": 1, "DOES NOT FIT": 2}  # FITS before TIGHT: an OOM costs more
    ranked.sort(key=lambda s: (order[s.report.verdict], -s.tokens_per_s_per_gpu))
    # the config's own layout, where it is one of the admitted ones
    p, ac = run.parallelism, run.activation_checkpoint.mode
    own = Candidate(
        world_size // max(1, p.tp * p.cp), p.tp, p.cp, ac, run.training.local_batch_size
    )
    if p.dp_replicate != 1 or p.dp_shard not in (-1, own.dp_shard) or own not in admitted:
        own = None
    return SuggestResult(
        world_size=world_size,
        gpu_kind=gpu,
        gpu=spec,
        seq_len=run_seq_len(run),
        global_batch_size=glob,
        num_params=next(iter(references.values())).counts.num_params,
        ranked=ranked,
        refused=refused,
        references=list(references.values()),
        own=own,
        elapsed_s=time.perf_counter() - start,
        network=net,
    )


def format_suggestions(result: SuggestResult, top: int = 8) -> str:
    """The ranking as the CLI prints it: the top layouts that fit, the config's own."""
    fitting = result.fitting
    gpu = result.gpu
    usable = result.ranked[0].report.usable_bytes / GIB
    ref = result.references[0].candidate
    lines = [
        f"suggest: {result.num_params / 1e9:.2f}B parameters on {result.world_size} x "
        f"{gpu.name}, seq {result.seq_len}, global batch {result.global_batch_size} sequences, "
        f"network {result.network.describe()}",
        f"{len(result.ranked)} layouts pass the launch rules ({result.refused} refused); "
        f"{len(fitting)} fit in {usable:.1f} GiB usable; ranked by predicted tokens/s/GPU "
        f"(~: within the held-out error of {HELD_OUT_TOKENS_PER_S[gpu.vendor]:.0%} of the first):",
        f"  {'#':>3} {'dp_shard':>8} {'tp':>3} {'cp':>3} {'AC':<9} {'local':>5} {'accum':>5} "
        f"{'tokens/s/GPU':>13} {'MFU':>5} {'step s':>8} {'reserved GiB':>12} "
        f"{'exposed comm':>16} {'verdict':<7}",
    ]

    def row(rank: str, s: Suggestion) -> str:
        c, r, p = s.candidate, s.report, s.report.prediction
        first = fitting[0] if fitting else None
        near = "~" if s is not first and result.within_error_of_first(s) else " "
        return (
            f"  {rank:>3} {c.dp_shard:>8} {c.tp:>3} {c.cp:>3} {c.ac:<9} {c.local_batch:>5} "
            f"{r.counts.accumulation:>5} {near}{p.tokens_per_s_per_gpu:>12,.0f} {p.mfu:>5.0%} "
            f"{p.step_s:>8.2f} {r.peak / GIB:>12.2f} "
            f"{p.exposed_comm_s:>8.2f} s ({p.exposed_comm_share:>3.0%}) {r.verdict:<7}"
        )

    lines += [row(str(i + 1), s) for i, s in enumerate(fitting[:top])]
    if not fitting:
        lines.append("  (no layout fits: more GPUs, or a smaller global batch or seq_len)")
    own = result.own_suggestion()
    if own is not None:
        i, s = own
        where = f"#{i + 1}" if s.report.runs else "does not fit"
        lines += [f"the config's own layout ({where}):", row("", s)]
    traced = ", ".join(f"{t.candidate.ac} {t.elapsed_s:.0f} s" for t in result.references)
    lines += [
        f"estimated from {len(result.references)} traced steps at tp {ref.tp}, cp {ref.cp}, "
        f"local batch {ref.local_batch} ({traced}; each also at twice the local batch), "
        f'scaled to each layout (docs/dry_run.md, "Suggest a layout"); '
        f"suggested in {result.elapsed_s:.0f} s",
    ]
    if fitting:
        lines.append(
            "plan the pick in full: python -m train --config CONFIG --dry-run --world-size "
            f"{result.world_size} --gpu {result.gpu_kind} {fitting[0].candidate.overrides()}"
        )
    return "\n".join(lines)


def format_comparison(results: list[SuggestResult]) -> str:
    """One line per GPU kind: its best layout and the config's own, tokens/s/GPU with the
    held-out range and the memory headroom (usable less the reserved peak's upper end)."""
    first = results[0]
    lines = [
        f"compare: {first.num_params / 1e9:.2f}B parameters on {first.world_size} GPUs, seq "
        f"{first.seq_len}, global batch {first.global_batch_size} sequences",
        f"  {'--gpu':<10} {'layout':<42} {'tokens/s/GPU':>13} {'range':>15} "
        f"{'reserved GiB':>12} {'headroom GiB':>12} {'verdict':<12} network",
    ]

    def line(kind: str, label: str, s: Suggestion | None, network: str) -> str:
        if s is None:
            return f"  {kind:<10} {label:<42} {'(no layout fits)':>13}"
        p, r = s.report.prediction, s.report
        low, high = held_out_range(p.tokens_per_s_per_gpu, HELD_OUT_TOKENS_PER_S[r.gpu.vendor])
        headroom = (r.usable_bytes - r.peak_range[1]) / GIB
        return (
            f"  {kind:<10} {label:<42} {p.tokens_per_s_per_gpu:>13,.0f} "
            f"{f'{low:,.0f}-{high:,.0f}':>15} {r.peak / GIB:>12.1f} {headroom:>12.1f} "
            f"{r.verdict:<12} {network}"
        )

    for result in results:
        best = result.fitting[0] if result.fitting else None
        label = f"best: {best.candidate.short()}" if best else "best"
        lines.append(line(result.gpu_kind, label, best, result.network.name))
        own = result.own_suggestion()
        if own is not None:
            lines.append(line("", f"own: {own[1].candidate.short()}", own[1], result.network.name))
    lines.append(
        "headroom: usable memory less the upper end of the reserved peak's held-out range; "
        "each GPU's layouts ranked in full with --gpu KIND alone"
    )
    return "\n".join(lines)


def run_suggest(run: Any, world_size: int, gpu: str, network: str | None = None) -> int:
    """`python -m train --dry-run --suggest`: print the ranking on the first `--gpu` kind,
    then, for several (`--gpu a,b,...`), their comparison; 0 if a layout fits (on any)."""
    kinds = [k.strip() for k in gpu.split(",") if k.strip()]
    if not kinds:
        raise ValueError("--gpu names no GPU kind; pass e.g. --gpu h100 or --gpu h100,mi300x")
    for kind in kinds:  # every kind known before anything is traced
        gpu_spec(kind, run)
    cache: dict = {}  # the references trace the same for every GPU kind
    results = [suggest(run, world_size, kind, cache, network) for kind in kinds]
    print(format_suggestions(results[0]), flush=True)  # the first kind's ranking in full
    if len(results) > 1:
        print("\n" + format_comparison(results), flush=True)
    return 0 if any(r.fitting for r in results) else 1
