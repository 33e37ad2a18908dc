"""FP8 numerics telemetry: what the float8 casts do to each linear's numbers, every few steps.

Why: an FP8 run fails numerically before it fails visibly. Every GEMM input is multiplied
by a scale and cast to float8 (train/fp8.py explains the recipes). The scale puts the
tensor's largest value (its amax) at the top of the float8 range, so everything more than
about 2^9 (e4m3) below the amax lands in the subnormals and, further down, flushes to zero:
an activation with a few huge outliers loses its small values. And when the cast uses a
scale computed from another tensor (the FP8 all-gather's precomputed weight scale) values
above the range are clamped. Neither shows in the loss until the run has drifted for days.
Transformer Engine reports such tensor statistics; torchao has none. So a 70B run needs, per
linear, the numbers that tell "fine" from "about to diverge", cheaply enough to leave on.

What is measured (every `fp8.stats_freq` steps; nothing at all on the other steps), per
torchao `Float8Linear` and for each of its three FP8 GEMM operands (input, weight,
grad_output), with the cast configuration of that linear's recipe (`cast_config_input`,
`cast_config_weight`, `cast_config_grad_output`: tensorwise or rowwise scales, e4m3 for
inputs and weights, e5m2 for tensorwise gradients, power-of-2 scales for rowwise):
- `amax`: the largest |x| (rowwise: over all rows) and `scale`: the scale the cast uses
  (rowwise: the smallest row scale, that of the largest row), both computed with torchao's
  own `tensor_to_amax` / `amax_to_scale`, so they are its numbers, not a re-derivation;
- `underflow`: the share of elements non-zero in high precision and zero after torchao's
  cast (`to_fp8_saturated`);
- `saturation`: the share clamped by the cast, i.e. |x * scale| beyond the float8 maximum
  by more than half a float8 step (a value within half a step of the maximum rounds to it
  anyway; the amax element itself lands on the maximum by construction). The maximum is
  the cast's own format's (`saturation_bound` of its `target_dtype`): e4m3 saturates at
  448 in the fn format and at 240 in fnuz (AMD MI300X/MI325X, common/fp8_formats.py), and
  each record names it (`max`), so a reading is never judged against the other format's;
- `gemm_rel_err`: ||y_fp8 - y_hp|| / ||y_hp|| on the first `fp8.stats_sample_rows` rows of
  the input, y_fp8 being the linear's real output and y_hp the same rows through the
  high-precision weight in fp32.

How:
1. `begin_step` (a stats step only) measures the weights as the parameters hold them, the
   local shard under FSDP: with the FP8 all-gather the forward sees only the float8 weight.
   A tensorwise weight uses the scale the all-gather will use (torchao's precomputed one),
   or the amax of the whole weight (one batched all-reduce MAX over all linears); a rowwise
   row is whole on its FSDP shard. It then installs a forward hook on every Float8Linear
   (input statistics, the GEMM error) that also hooks the output's gradient (grad_output).
   Micro-batches of gradient accumulation add up; `end_step` removes the hooks, so
   validation and every other step run untouched.
2. `metrics(step)`, called while the step's metrics are logged (all ranks), reduces a
   (linears x 13) tensor across ranks in one all-reduce MAX: the largest amax, the smallest
   scale, the worst rank's underflow / saturation share and GEMM error. Rank 0 then writes
   the per-linear detail to `RUN/fp8_stats.jsonl` and a warning naming the linears over
   `fp8.stats_underflow_warn` / `fp8.stats_saturation_warn` (one line per kind and stats
   step, the three worst named: readable at any number of ranks), and returns the summary
   per layer type (`attention.wq` over all layers: max amax, min scale, worst shares, mean
   GEMM error), which train/components/metrics.py writes to metrics.jsonl and TensorBoard as
   `fp8/<type>/<operand>_<stat>`. `stats_freq` is a multiple of `metrics.log_freq` (the
   config checks it), so every stats step is a logged step.

Limits: under tensor parallelism the statistics are those of each rank's local shard (a
rowwise-parallel weight's rows are split), and an input torchtitan's float8 TP styles
already cast is skipped; with the FP8 all-gather the GEMM reference uses the gathered
float8 weight (the forward holds no other), so the error then leaves the weight's own
rounding out, which its underflow/saturation shares report. In blocks compiled by
`torch.compile` (torchtitan compiles each transformer block, fullgraph) the hooks do
nothing: a block compiled without them does not call hooks added later, and one traced
with them must not capture their side effects (dynamo refuses them under fullgraph), so
the hooks return at once while being traced. There only the weights are measured, and
the first stats step says so in one line (tests/train/components/test_fp8_stats.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.io import append_jsonl
from common.run_layout import FP8_STATS
from train.shards import local_shard
from train.step_hooks import StepHook

OPERANDS = ("input", "weight", "grad_output")
STATS = ("amax", "scale", "underflow", "saturation")
# one row per linear: 4 stats per operand, then the GEMM error; the scale is reduced as
# -scale so that one MAX all-reduce gives the smallest scale; MISSING where not measured
_WIDTH = len(OPERANDS) * len(STATS) + 1
MISSING = -math.inf
_CHUNK_ELEMENTS = 1 << 24  # counting works on row blocks of this size: bounded extra memory


@dataclass
class CastStats:
    """One operand's statistics on this rank, summed over micro-batches."""

    amax: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    underflow: float | torch.Tensor = 0.0
    saturation: float | torch.Tensor = 0.0
    numel: int = 0

    def add(self, other: CastStats) -> None:
        self.amax = other.amax if self.amax is None else torch.maximum(self.amax, other.amax)
        self.scale = other.scale if self.scale is None else torch.minimum(self.scale, other.scale)
        self.underflow = self.underflow + other.underflow
        self.saturation = self.saturation + other.saturation
        self.numel += other.numel

    def row(self) -> list:
        if not self.numel:
            return [MISSING] * len(STATS)
        return [self.amax, -self.scale, self.underflow / self.numel, self.saturation / self.numel]


@dataclass
class LinearStats:
    operands: dict[str, CastStats] = field(
        default_factory=lambda: {name: CastStats() for name in OPERANDS}
    )
    rel_err_sum: float | torch.Tensor = 0.0
    rel_err_count: int = 0


def saturation_bound(float8_dtype: torch.dtype) -> float:
    """|x * scale| at or beyond this is clamped by the cast: the float8 maximum plus half
    the step between representable numbers at the maximum (anything below rounds to the
    maximum anyway)."""
    info = torch.finfo(float8_dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


@torch.no_grad()
def cast_stats(x: torch.Tensor, cast_config, round_scales_to_power_of_2: bool, scale=None):
    """Statistics of torchao's float8 cast of `x` (2-D; rowwise scales along its last
    dimension, as torchao scales inputs and grad_outputs, and weights per output row).
    `scale`: a scale already decided (tensorwise: the all-gather's, or the whole sharded
    weight's); otherwise torchao's dynamic scale of `x`."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax, to_fp8_saturated

    dtype = cast_config.target_dtype
    rowwise = cast_config.scaling_granularity is ScalingGranularity.AXISWISE
    granularity = cast_config.scaling_granularity
    bound = saturation_bound(dtype)
    if scale is not None:
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    elif not rowwise and x.numel():
        scale = amax_to_scale(tensor_to_amax(x), dtype, round_scales_to_power_of_2)
    stats = CastStats(numel=x.numel())
    rows = max(1, _CHUNK_ELEMENTS // max(1, x.shape[-1]))
    for chunk in x.split(rows):
        amax = tensor_to_amax(chunk, scaling_granularity=granularity, axiswise_dim=-1)
        chunk_scale = amax_to_scale(amax, dtype, round_scales_to_power_of_2) if rowwise else scale
        scaled = chunk.to(torch.float32) * chunk_scale  # torchao's own cast, step by step
        casted = to_fp8_saturated(scaled, dtype)
        part = CastStats(
            amax=amax.max().to(torch.float32),
            scale=chunk_scale.min().to(torch.float32),
            underflow=((chunk != 0) & (casted == 0)).sum(),
            saturation=(scaled.abs() >= bound).sum(),
        )
        stats.add(part)
    return stats


def _local_amax(t: torch.Tensor) -> torch.Tensor:
    """torchao's tensorwise amax of a local shard; 0 for an empty shard (more ranks than rows)."""
    from torchao.float8.float8_utils import tensor_to_amax

    return tensor_to_amax(t) if t.numel() else torch.zeros((), dtype=t.dtype, device=t.device)


def _is_float8(t: torch.Tensor) -> bool:
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    return isinstance(local_shard(t), Float8TrainingTensor)


def _high_precision(weight: torch.Tensor) -> torch.Tensor:
    """The weight as a plain tensor: the local shard, unwrapped from torchao's FP8
    all-gather wrapper, or a gathered float8 weight dequantized."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    local = local_shard(weight)
    if isinstance(local, WeightWithDynamicFloat8CastTensor):
        return local._tensor
    if isinstance(local, Float8TrainingTensor):
        return local.to_original_precision()
    return local


def layer_type(fqn: str) -> str:
    """`layers.3.attention.wq` -> `attention.wq`: the name after the last layer index."""
    parts = fqn.split(".")
    digits = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[digits[-1] + 1 :]) if digits and digits[-1] < len(parts) - 1 else fqn


class Fp8Telemetry(StepHook):
    """A step hook: collects the statistics on stats steps (see the module docstring)."""

    def __init__(self, fp8_config, model_parts, run_folder: str, log=None):
        from torchao.float8.float8_linear import Float8Linear

        self.config = fp8_config
        self.linears = {
            name: module
            for model in model_parts
            for name, module in model.named_modules()
            if isinstance(module, Float8Linear)
        }
        self.freq = fp8_config.stats_freq if fp8_config.enable and self.linears else 0
        self.path = f"{run_folder}/{FP8_STATS}"
        self.log = log
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._handles: list = []
        self._stats: dict[str, LinearStats] = {}
        self._step = -1
        self._said_weights_only = False

    @classmethod
    def from_trainer(cls, trainer) -> Fp8Telemetry:
        from torchtitan.tools.logging import logger

        config = trainer.config
        return cls(config.fp8, trainer.model_parts, config.dump_folder, logger.warning)

    # ------------------------------------------------------------------ collection
    def begin_step(self, step: int) -> None:
        if not self.freq or step % self.freq:  # not a stats step
            return
        self._step = step
        self._stats = {name: LinearStats() for name in self.linears}
        self._measure_weights()
        for name, module in self.linears.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def end_step(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _measure_weights(self) -> None:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import amax_to_scale

        scales: dict[str, torch.Tensor] = {}
        undecided = []  # tensorwise weights whose scale needs the whole weight's amax
        for name, module in self.linears.items():
            cast = module.config.cast_config_weight
            if cast.scaling_granularity is not ScalingGranularity.TENSORWISE:
                continue
            # torchao's FP8 all-gather wrapper (WeightWithDynamicFloat8CastTensor) may hold it
            precomputed = getattr(local_shard(module.weight), "_precomputed_scale", None)
            if precomputed is not None:
                scales[name] = precomputed
            else:
                undecided.append(name)
        if undecided:
            amax = torch.stack(
                [_local_amax(_high_precision(self.linears[n].weight)) for n in undecided]
            ).to(torch.float32)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            for name, value in zip(undecided, amax, strict=True):
                config = self.linears[name].config
                scales[name] = amax_to_scale(
                    value, config.cast_config_weight.target_dtype, config.round_scales_to_power_of_2
                )
        for name, module in self.linears.items():
            cast, weight = module.config.cast_config_weight, _high_precision(module.weight)
            if cast.scaling_type.value == "disabled" or weight.numel() == 0:
                continue
            self._stats[name].operands["weight"].add(
                cast_stats(weight, cast, module.config.round_scales_to_power_of_2, scales.get(name))
            )

    def _forward_hook(self, name: str):
        stats = self._stats[name]

        def hook(module, args, output):
            if torch.compiler.is_compiling():  # traced into a compiled block: see Limits
                return
            config, x = module.config, args[0]
            pow2 = config.round_scales_to_power_of_2
            if _is_float8(x) or config.cast_config_input.scaling_type.value == "disabled":
                return
            with torch.no_grad():
                x2 = local_shard(x).reshape(-1, x.shape[-1])
                stats.operands["input"].add(cast_stats(x2, config.cast_config_input, pow2))
                out = local_shard(output)
                rows = min(self.config.stats_sample_rows, x2.shape[0])
                sample = x2[:rows].to(torch.float32)
                weight = _high_precision(module.weight).to(torch.float32)
                got = out.reshape(-1, out.shape[-1])[:rows].to(torch.float32)
                if module.bias is not None:
                    got = got - local_shard(module.bias).to(torch.float32)
                if weight.shape[-1] == sample.shape[-1] and weight.shape[0] == got.shape[-1]:
                    want = sample @ weight.t()
                    err = torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(
                        want
                    ).clamp_min(torch.finfo(torch.float32).tiny)
                    stats.rel_err_sum = stats.rel_err_sum + err
                    stats.rel_err_count += 1
            grad_cast = config.cast_config_grad_output
            if output.requires_grad and grad_cast.scaling_type.value != "disabled":

                def grad_hook(grad):
                    if not _is_float8(grad) and not torch.compiler.is_compiling():
                        g = local_shard(grad)
                        g = g.reshape(-1, g.shape[-1])
                        stats.operands["grad_output"].add(cast_stats(g, grad_cast, pow2))

                output.register_hook(grad_hook)

        return hook

    # ------------------------------------------------------------------ reduction
    def metrics(self, step: int) -> dict[str, float]:
        """The per-type summary for metrics.jsonl/TensorBoard on a stats step (collective:
        every rank calls it while logging); {} on other steps."""
        if step != self._step or not self._stats:
            return {}
        names = list(self.linears)
        device = next(iter(self.linears.values())).weight.device
        table = torch.full((len(names), _WIDTH), MISSING, dtype=torch.float32, device=device)
        for i, name in enumerate(names):
            s = self._stats[name]
            values = [v for op in OPERANDS for v in s.operands[op].row()]
            values.append(s.rel_err_sum / s.rel_err_count if s.rel_err_count else MISSING)
            table[i] = torch.stack(
                [torch.as_tensor(v, dtype=torch.float32, device=device) for v in values]
            )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        self._stats = {}
        maxima = {name: operand_maxima(self.linears[name].config) for name in names}
        detail = _detail(names, table.cpu().tolist(), maxima)
        if self.rank == 0:
            append_jsonl(self.path, {"step": step, "linears": detail})
            self._warn(step, detail)
            if not self._said_weights_only and not any("input" in d for d in detail.values()):
                self._said_weights_only = True
                if self.log is not None:
                    self.log(
                        "FP8 telemetry: no linear's forward hook ran (blocks compiled by "
                        "torch.compile do not call hooks added later): weights measured only"
                    )
        return summarize(detail)

    def _warn(self, step: int, detail: dict[str, dict]) -> None:
        if self.log is None:
            return
        for kind, threshold, key in (
            ("underflow", self.config.stats_underflow_warn, "stats_underflow_warn"),
            ("saturation", self.config.stats_saturation_warn, "stats_saturation_warn"),
        ):
            worst_first = worst_linears([{"step": step, "linears": detail}], kind)
            over = [(share, name, op) for share, name, op, _ in worst_first if share > threshold]
            if not over:
                continue
            worst = ", ".join(
                f"{name} {op} {share:.3%}"
                + (f" (float8 max {detail[name][op]['max']:g})" if kind == "saturation" else "")
                for share, name, op in over[:3]
            )
            more = f" (+{len(over) - 3} more)" if len(over) > 3 else ""
            self.log(
                f"FP8 {kind} at step {step}: {worst}{more} of elements "
                f"{'flush to zero' if kind == 'underflow' else 'clamped'} in the float8 cast, "
                f"over fp8.{key} = {threshold:.3%} (RUN/{FP8_STATS} has every linear)"
            )


def operand_maxima(config) -> dict[str, float]:
    """The float8 maximum each operand of a linear is cast against (its `target_dtype`:
    448 for e4m3fn, 240 for e4m3fnuz, 57344 for either e5m2; common/fp8_formats.py)."""
    return {
        op: float(torch.finfo(getattr(config, f"cast_config_{op}").target_dtype).max)
        for op in OPERANDS
    }


def _detail(
    names: list[str], table: list[list[float]], maxima: dict[str, dict[str, float]]
) -> dict[str, dict]:
    """{linear: {operand: {stat: value, "max": the float8 maximum}, "gemm_rel_err": value}},
    unmeasured values left out."""
    detail: dict[str, dict] = {}
    for name, row in zip(names, table, strict=True):
        entry: dict = {}
        for k, op in enumerate(OPERANDS):
            values = row[k * len(STATS) : (k + 1) * len(STATS)]
            if values[0] == MISSING:
                continue
            entry[op] = dict(zip(STATS, values, strict=True))
            entry[op] |= {"scale": -entry[op]["scale"], "max": maxima[name][op]}
        if row[-1] != MISSING:
            entry["gemm_rel_err"] = row[-1]
        detail[name] = entry
    return detail


def summarize(detail: dict[str, dict]) -> dict[str, float]:
    """Per layer type over all layers: max amax, min scale, worst underflow and saturation
    share, mean GEMM error, as `fp8/<type>/<operand>_<stat>` and `fp8/<type>/gemm_rel_err`."""
    groups: dict[str, list[dict]] = {}
    for name, entry in detail.items():
        groups.setdefault(layer_type(name), []).append(entry)
    summary: dict[str, float] = {}
    for kind, entries in groups.items():
        for op in OPERANDS:
            measured = [e[op] for e in entries if op in e]
            for stat in STATS if measured else ():
                pick = min if stat == "scale" else max  # the smallest scale, else the largest
                summary[f"fp8/{kind}/{op}_{stat}"] = pick(m[stat] for m in measured)
        errors = [e["gemm_rel_err"] for e in entries if "gemm_rel_err" in e]
        if errors:
            summary[f"fp8/{kind}/gemm_rel_err"] = sum(errors) / len(errors)
    return summary


def worst_linears(records: list[dict], stat: str) -> list[tuple[float, str, str, int]]:
    """Every (value, linear, operand, step) of `stat` ("amax", "underflow", "saturation",
    ...) in RUN/fp8_stats.jsonl's records, the largest first (in file order among equals):
    the warning's, the forensics table's and the quickstart summary's one ranking."""
    found = [
        (entry[op][stat], name, op, record.get("step", 0))
        for record in records
        for name, entry in record.get("linears", {}).items()
        for op in OPERANDS
        if stat in entry.get(op, {})
    ]
    return sorted(found, key=lambda worst: -worst[0])
