"""FP8 training: which linears run in float8, and how their weights travel between GPUs.

Why FP8: on an H100 a float8 GEMM runs at about twice the bf16 rate, and a weight moved
in float8 is half the bytes. The price is range: float8 e4m3 holds about two decimal digits
and values up to 448 (240 in AMD MI300's fnuz encoding: `fp8.format`, the GPU's by
default, written into every cast by `with_fp8_format`; common/fp8_formats.py says why), so
every tensor is multiplied by a scale before the cast (so its largest value lands near the
top of the range) and divided by it after the GEMM. Where the
scales come from is the recipe: `tensorwise` takes one scale per tensor (fastest; the one
torchao can all-gather in float8), `rowwise` one per row (robust to outlier rows). The
master weights, gradients and optimizer state stay in high precision; only the GEMM
inputs are float8. The output projection (`lm_head`) stays in bf16: the logits are where
small errors show most.

Why FSDP float8 all-gather matters: FSDP gathers every weight shard before each forward
and backward. Gathering them already cast to float8 halves those bytes (a bf16 weight is
2 bytes, a float8 one 1 byte), the largest collective of a data-parallel run. Each rank
casts its own shard with one scale shared by the whole weight, so the scale must be known
before the gather: torchao computes the scales of all weights once after each optimizer
step, in one batched reduction (`refresh_fp8_all_gather_scales`), instead of one
all-reduce per weight inside the gather.

How:
1. Conversion happens on the config tree, before the model exists:
   `Fp8LinearConverter` (torchtitan's `Float8LinearConverter` plus the `tensorwise`
   recipe and the all-gather flag, both missing in torchtitan 0.3.0) swaps each eligible
   `Linear.Config` for torchao's `Float8Linear` (`fp8_converter_config(run)`). Eligible:
   dims multiples of 16, name not in `fp8.filter_fqns`, and with `auto_filter_small_kn`
   above torchao's size thresholds for the recipe, asked of torchao's own rule on the
   config's shape (`size_filter`: torchtitan 0.3.0 hands that rule a `Linear.Config`, which
   it rejects, so with the flag on nothing converted). A config that enables FP8 and
   converts nothing is refused at start-up (`check_fp8_converts`), unless
   `fp8.allow_no_conversion` says that is meant.
2. torchao moves a weight in float8 only when the parameter is a
   `WeightWithDynamicFloat8CastTensor` (its `fsdp_pre_all_gather` casts the local shard
   before FSDP gathers it). torchao wraps weights that way in `Float8Linear.from_float`,
   but torchtitan builds `Float8Linear` through `__init__`, so its weights stay plain.
   `parallelize_llama_fp8` therefore wraps them (`wrap_fp8_all_gather_weights`) on the
   meta model, just before torchtitan's `parallelize_llama` applies TP, AC, compile and
   FSDP2 (torchao's own FSDP2 recipe order: convert, then shard), and only when FSDP is
   on. Checkpoints still hold the plain weight (`_plain_weight_in_state_dict`).
3. After each optimizer step the trainer calls `refresh_fp8_all_gather_scales`.
4. `describe_fp8_linears` reads what the model really holds, for the start-up log.

On CPU `torch._scaled_mm` runs real float8 GEMMs; only torchtitan's SM89 check is passed
there (`train.compat.cpu_compat.float8_capability_check`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from train.config import RunConfig


def _fp8_converter_cls():
    from torchtitan.components.quantization import Float8LinearConverter

    class Fp8LinearConverter(Float8LinearConverter):
        """torchtitan's converter plus the tensorwise recipe, FP8 FSDP all-gather and
        torchao's size filter applied to the `Linear.Config` shapes (module docstring, 1)."""

        @dataclass(kw_only=True, slots=True)
        class Config(Float8LinearConverter.Config):
            recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "rowwise"
            fp8_format: Literal["fn", "fnuz"] = "fn"
            """The FP8 encoding every cast uses, resolved for the device (`with_fp8_format`)."""
            fsdp_float8_all_gather: bool = True
            """Only meaningful for tensorwise (torchao supports it for no other recipe)."""
            auto_filter_small_kn: bool = False
            """Keep linears below torchao's size thresholds for the recipe in high precision
            (`size_filter`); replaces torchtitan's "auto_filter_small_kn" entry in
            `filter_fqns`, which converts nothing in torchtitan 0.3.0."""

        def __init__(self, config: Config):
            from train.compat import cpu_compat

            # torchtitan refuses devices below SM89; a CPU has real float8 GEMMs
            with cpu_compat.float8_capability_check():
                super().__init__(config)
            if not self.enabled:
                return
            # torchao all-gathers in float8 for the tensorwise recipe only
            all_gather = config.recipe_name == "tensorwise" and config.fsdp_float8_all_gather
            self.torchao_config = with_fp8_format(
                dataclasses.replace(
                    self.torchao_config,
                    enable_fsdp_float8_all_gather=all_gather and not config.emulate,
                ),
                config.fp8_format,
            )
            if config.auto_filter_small_kn:
                self.filter_fn = size_filter(config.recipe_name, config.filter_fqns)

    return Fp8LinearConverter


def with_fp8_format(torchao_config, fp8_format: str):
    """torchao's `Float8LinearConfig` with every cast's `target_dtype` in `fp8_format`
    (`common.fp8_formats`): e4m3 casts stay e4m3 and e5m2 casts e5m2, in that format.

    Why explicit: torchao fills the casts from the module globals it picked once at
    import (`torchao.float8.config.e4m3_dtype`: fnuz only on an MI300 seen at import,
    train/compat/amd_compat.py), so a config cannot ask for the other format, and a test
    cannot train in fnuz without the hardware. Every consumer of the format reads the
    casts' `target_dtype`: the casts and GEMMs (`Float8Linear`), the FSDP float8
    all-gather (`WeightWithDynamicFloat8CastTensor`, given the weight cast's dtype), the
    scale precomputation and the telemetry (train/components/fp8_stats.py). One thing
    still reads the globals: torchao's `CastConfig.short_str`, used only by
    `Float8Linear.extra_repr`, which raises KeyError in a format torchao did not pick (a
    forced format on CPU): printing such a model is the one thing not to do."""
    import torch

    from common.fp8_formats import FORMATS

    fmt = FORMATS[fp8_format]

    def in_format(cast):  # an e5m2 cast stays e5m2, every other one is e4m3
        assert "float8" in str(cast.target_dtype), cast
        kind = fmt.e5m2 if "e5m2" in str(cast.target_dtype) else fmt.e4m3
        return dataclasses.replace(cast, target_dtype=getattr(torch, kind))

    casts = {
        f.name: in_format(getattr(torchao_config, f.name))
        for f in dataclasses.fields(torchao_config)
        if f.name.startswith("cast_config_")
    }
    return dataclasses.replace(torchao_config, **casts)


def check_fp8_device(run: RunConfig, amd_archs: list[str]) -> None:
    """The FP8 rules that need the node's GPUs, torch-free (`train.preflight`: the
    launchers' `--check` and every worker): `amd_archs` are the AMD architectures
    `amd-smi` reports (`common.launch_env.amd_gpu_archs`). MXFP8 is refused everywhere for
    now, naming MI355's case (train/compat/amd_compat.py, 2); an explicit `fp8.format` the
    node's AMD GPUs lack is refused (the torch-side check, `train.build.resolve_fp8_format`,
    covers NVIDIA). ValueError, one line."""
    from common.fp8_formats import describe_arch, has_mx
    from train.compat.amd_compat import check_fp8_format

    f = run.fp8
    if f.enable and f.recipe == "mxfp8":
        mx = [a for a in amd_archs if has_mx(a)]
        if mx:
            raise ValueError(
                f"fp8.recipe = 'mxfp8' on AMD {describe_arch(mx[0])}: the GPU has MXFP8 "
                "GEMMs, but torchtitan 0.3.0's MXFP8LinearConverter accepts only NVIDIA "
                "SM100+ (torchtitan/components/quantization/mx.py); use recipe 'rowwise' "
                "or 'tensorwise' (FP8 in the fn format there) until it accepts ROCm"
            )
        raise ValueError(
            "fp8.recipe = 'mxfp8': this project does not wire torchtitan's MXFP8 converter "
            "yet (train/compat/amd_compat.py); use recipe 'rowwise' or 'tensorwise'"
        )
    if f.enable and amd_archs:
        check_fp8_format(f.format, amd_archs[0], accelerator=True)


def size_filter(recipe: str, filter_fqns: list[str]):
    """`(Linear.Config, fqn) -> bool`: whether torchao's own auto filter for `recipe`
    (`torchao.float8._auto_filter_for_recipe`: dims multiples of 16, above its per-recipe
    size thresholds, fqn not in `filter_fqns`) would convert an `nn.Linear` of that shape.

    Why: torchtitan 0.3.0 passes torchao's filter the `Linear.Config` of the config tree,
    but the filter starts with `isinstance(mod, nn.Linear)` and reads `mod.weight.shape`,
    so it answers False for every linear and an FP8 run trains in high precision. Here the
    rule sees an `nn.Linear` of the config's shape on the meta device (no memory), so the
    thresholds stay torchao's. Retire when torchtitan applies the filter to the shapes
    (its `Float8LinearConverter.convert` calling `filter_fn` on a module, or a torchao
    filter taking (in_features, out_features))."""
    import torch
    from torchao.float8 import _auto_filter_for_recipe

    try:
        rule = _auto_filter_for_recipe(recipe, filter_fqns=list(filter_fqns))
    except NotImplementedError:
        raise ValueError(
            f"fp8.auto_filter_small_kn: torchao has no size thresholds for recipe "
            f"'{recipe}'; use recipe 'rowwise' or 'tensorwise', or set "
            "auto_filter_small_kn = false and list the linears to skip in fp8.filter_fqns"
        ) from None

    def converts(linear_config, fqn: str) -> bool:
        probe = torch.nn.Linear(
            linear_config.in_features, linear_config.out_features, bias=False, device="meta"
        )
        return rule(probe, fqn)

    return converts


def check_fp8_converts(run: RunConfig, model_config) -> int:
    """How many `Linear.Config`s of the converted `model_config` are float8 ones (one config
    can build several modules: llama3's `wkv` builds wk and wv); a config that asks for FP8
    (`fp8.enable`) and converts none is refused (ValueError, one line) unless it says so
    (`fp8.allow_no_conversion`). Without this such a run trains in high precision and only
    the start-up log's "FP8: off" says so."""
    from torchtitan.components.quantization import Float8Linear
    from torchtitan.models.common import Linear

    if not run.fp8.enable:
        return 0
    linears = [config for _, config, _, _ in model_config.traverse(Linear.Config)]
    converted = sum(isinstance(config, Float8Linear.Config) for config in linears)
    if converted or run.fp8.allow_no_conversion:
        return converted
    f = run.fp8
    filters = [f"fp8.filter_fqns = {list(f.filter_fqns)}"]
    if f.auto_filter_small_kn:
        filters.append(f"fp8.auto_filter_small_kn = true (torchao's '{f.recipe}' size thresholds)")
    raise ValueError(
        f"fp8.enable = true but no linear of the model is converted to float8 "
        f"({', '.join(filters)}; dims must be multiples of 16): the run would train in "
        "high precision. Convert some (shorten filter_fqns, set auto_filter_small_kn = false), "
        "set fp8.enable = false, or set fp8.allow_no_conversion = true if that is intended"
    )


def wrap_fp8_all_gather_weights(model) -> int:
    """Make each Float8Linear configured for the FSDP float8 all-gather hold its weight as
    torchao's `WeightWithDynamicFloat8CastTensor` (what `Float8Linear.from_float` does).
    Call before FSDP shards the model; returns how many weights are wrapped."""
    import torch
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    wrapped = 0
    for module in model.modules():
        if not (isinstance(module, Float8Linear) and module.config.enable_fsdp_float8_all_gather):
            continue
        if not isinstance(module.weight, WeightWithDynamicFloat8CastTensor):
            module.weight = torch.nn.Parameter(
                WeightWithDynamicFloat8CastTensor(
                    module.weight,
                    module.linear_mm_config,
                    module.config.cast_config_weight.target_dtype,
                ),
                requires_grad=module.weight.requires_grad,
            )
            module.register_state_dict_post_hook(_plain_weight_in_state_dict)
        wrapped += 1
    return wrapped


def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """Checkpoints hold the plain high-precision weight, not torchao's wrapper: DCP and
    torchtitan's state-dict cache need real storage, and export/eval read plain tensors.
    The plain tensor shares the parameter's storage, so loading into it loads the weight."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and isinstance(
        value._local_tensor, WeightWithDynamicFloat8CastTensor
    ):
        state_dict[key] = DTensor.from_local(
            value._local_tensor._tensor,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    elif isinstance(value, WeightWithDynamicFloat8CastTensor):
        state_dict[key] = value._tensor


def fp8_all_gather_weights(model) -> list[str]:
    """Names of the Float8Linear modules whose (local) weight FSDP gathers in float8: what
    the model really holds, not what the config asked for."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    names = []
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            weight = module.weight
            local = weight._local_tensor if isinstance(weight, DTensor) else weight
            if isinstance(local, WeightWithDynamicFloat8CastTensor):
                names.append(name)
    return names


def parallelize_llama_fp8(model, *, parallel_dims, **kwargs):
    """torchtitan's `parallelize_llama`, with FP8 all-gather weights wrapped first when
    FSDP is on (step 2 of the module docstring)."""
    from torchtitan.models.llama3 import parallelize_llama

    if parallel_dims.fsdp_enabled:
        wrap_fp8_all_gather_weights(model)
    return parallelize_llama(model, parallel_dims=parallel_dims, **kwargs)


def fp8_converter_config(run: RunConfig, fp8_format: str = "fn"):
    """The converter's config for `run`; `fp8_format` is `fp8.format` already resolved for
    the device (`train.build.resolve_fp8_format`)."""
    assert run.fp8.recipe != "mxfp8", "mxfp8 is refused before launch (check_fp8_device)"
    cls = _fp8_converter_cls()
    return cls.Config(
        recipe_name=run.fp8.recipe,
        fp8_format=fp8_format,
        filter_fqns=list(run.fp8.filter_fqns),
        auto_filter_small_kn=run.fp8.auto_filter_small_kn,
        emulate=run.fp8.emulate,
        fsdp_float8_all_gather=run.fp8.fsdp_float8_all_gather,
        model_compile_enabled=run.compile.enable and "model" in run.compile.components,
    )


def refresh_fp8_all_gather_scales(model_parts) -> None:
    """After an optimizer step: torchao's batched scale computation for every weight that
    FSDP gathers in float8 (the next forward's all-gather casts with these scales)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for model in model_parts:
        precompute_float8_dynamic_scale_for_fsdp(model)


def model_fp8_format(model_parts) -> str:
    """The FP8 format the model's float8 casts use ("fn" or "fnuz"), read off its
    `Float8Linear`s; "" when none is converted."""
    import torch
    from torchao.float8.float8_linear import Float8Linear

    fnuz = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    for model in model_parts:
        for module in model.modules():
            if isinstance(module, Float8Linear):
                return "fnuz" if module.config.cast_config_input.target_dtype in fnuz else "fn"
    return ""


def describe_fp8_linears(model_parts) -> tuple[str, bool]:
    """(one line for the start-up log, whether any weight is gathered in float8), read off
    the modules and parameters, not the config."""
    import torch
    from torchao.float8.float8_linear import Float8Linear

    converted, kept, gathered, emulate = [], [], [], False
    for model in model_parts:
        gathered += fp8_all_gather_weights(model)
        for name, module in model.named_modules():
            if isinstance(module, Float8Linear):
                converted.append(name)
                emulate = emulate or module.config.emulate
            elif isinstance(module, torch.nn.Linear):
                kept.append(name)
    if not converted:
        return "FP8: off (all linears in high precision)", False
    gemm = "emulated (high-precision GEMMs)" if emulate else "real float8 GEMMs (torch._scaled_mm)"
    all_gather = f"on for {len(gathered)} weights" if gathered else "off"
    fmt = model_fp8_format(model_parts)
    line = (
        f"FP8: {len(converted)} linears converted, {gemm}, {fmt} format; FSDP float8 all-gather "
        f"{all_gather}; converted: {', '.join(converted)}; "
        f"kept in high precision: {', '.join(kept) or 'none'}"
    )
    return line, bool(gathered)
