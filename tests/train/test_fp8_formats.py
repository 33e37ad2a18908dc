"""The FP8 format (common/fp8_formats.py): chosen by the device, written into every torchao
cast, and checked against the node's AMD GPUs before launch.

The training itself in both formats (and a run moving between them) is
tests/train/test_fp8_vs_bf16.py's training matrix; the telemetry's maximum per format is
tests/train/components/test_fp8_stats.py's; serving's rule against vLLM's own ROCm code is
tests/eval/test_serve_rocm.py's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.train.test_bad_inputs import assert_one_line_error
from tests.utils.amd import MI300X, MI355X, fake_amd_smi
from tests.utils.runs import check_ok, cli, train_env


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_every_torchao_cast_takes_the_format(recipe):
    """torchao fills its casts from the format it picked at import (fn on this CPU); the
    config drives them instead: e4m3 stays e4m3 and e5m2 stays e5m2, in the format asked."""
    from torchao.float8 import Float8LinearConfig

    from train.fp8 import with_fp8_format

    torchao = Float8LinearConfig.from_recipe_name(recipe)
    assert with_fp8_format(torchao, "fn") == torchao  # the format torchao picked here
    fnuz = with_fp8_format(torchao, "fnuz")
    # every cast torchao's config has, read from torchao itself: a cast it adds is checked too
    casts = [f.name for f in dataclasses.fields(torchao) if f.name.startswith("cast_")]
    assert len(casts) == 6, casts
    kinds = {torch.float8_e4m3fn: torch.float8_e4m3fnuz, torch.float8_e5m2: torch.float8_e5m2fnuz}
    for name in casts:
        assert getattr(fnuz, name).target_dtype == kinds[getattr(torchao, name).target_dtype]
        assert getattr(fnuz, name).scaling_type == getattr(torchao, name).scaling_type
    assert fnuz.round_scales_to_power_of_2 == torchao.round_scales_to_power_of_2


def test_the_format_comes_from_the_device():
    from train.build import resolve_fp8_format
    from train.compat.amd_compat import check_fp8_format

    assert resolve_fp8_format("auto") == "fn"  # this CPU
    assert resolve_fp8_format("fnuz") == "fnuz"  # a CPU computes both: how fnuz is tested
    # on GPUs: auto is the device's; a forced format the GPU lacks is one line
    assert check_fp8_format("auto", "gfx942:sramecc+:xnack-", accelerator=True) == "fnuz"
    assert check_fp8_format("auto", "gfx950", accelerator=True) == "fn"  # MI355X: OCP
    assert check_fp8_format("auto", None, accelerator=True) == "fn"  # NVIDIA
    with pytest.raises(ValueError, match=r"^fp8.format = 'fn' but this AMD gfx942 \(MI300X"):
        check_fp8_format("fn", "gfx942", accelerator=True)
    with pytest.raises(ValueError, match="this NVIDIA GPU computes FP8 in the 'fn' format only"):
        check_fp8_format("fnuz", None, accelerator=True)


def test_fp8_rules_of_the_node_are_one_line_before_launch(run_toml, tmp_path):
    """`python -m train --check` (what every launcher runs first, torch-free) reads the
    node's AMD GPUs from amd-smi (a stand-in here): MXFP8 on an MI355X names torchtitan's
    converter, a forced format an MI300X lacks is refused, the device's own passes."""
    mi355x = dict(train_env(), PATH=fake_amd_smi(tmp_path / "mi355x", *[MI355X] * 8))
    mi300x = dict(train_env(), PATH=fake_amd_smi(tmp_path / "mi300x", *[MI300X] * 8))
    config = str(run_toml())
    assert_one_line_error(
        cli("--config", config, "--check", "--fp8.recipe", '"mxfp8"', env=mi355x),
        "fp8.recipe = 'mxfp8' on AMD gfx950 (MI350X/MI355X)",
        "MXFP8LinearConverter accepts only NVIDIA SM100+",
        "until it accepts ROCm",
    )
    assert_one_line_error(
        cli("--config", config, "--check", "--fp8.recipe", '"mxfp8"'),
        "fp8.recipe = 'mxfp8': this project does not wire torchtitan's MXFP8 converter",
    )
    assert_one_line_error(
        cli("--config", config, "--check", "--fp8.format", '"fn"', env=mi300x),
        "fp8.format = 'fn' but this AMD gfx942 (MI300X/MI300A/MI325X) GPU computes",
        "'fnuz' format only",
    )
    check_ok(cli("--config", config, "--check", "--fp8.format", '"fnuz"', env=mi300x))


def test_the_fsdp_float8_all_gather_casts_in_the_format():
    """Tensorwise + FSDP gathers weights already cast: torchao's wrapper takes the weight
    cast's dtype, so in fnuz the gathered bytes are fnuz (what train.fp8 wraps them with)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from tests.utils.runs import REPO
    from train.config import load_config
    from train.fp8 import model_fp8_format, wrap_fp8_all_gather_weights
    from train.model import build_model_spec

    run = load_config(REPO / "configs" / "debug.toml", ["--model.n_layers=1"])
    run.fp8.recipe = "tensorwise"
    model = build_model_spec(run, fp8_format="fnuz").model.build()
    assert wrap_fp8_all_gather_weights(model) == 7  # wq, wk, wv, wo, w1, w2, w3
    dtypes = {
        p._dtype for p in model.parameters() if isinstance(p, WeightWithDynamicFloat8CastTensor)
    }
    assert dtypes == {torch.float8_e4m3fnuz}
    assert model_fp8_format([model]) == "fnuz"
