"""FP8 numerics telemetry (train/components/fp8_stats.py) on a single torchao Float8Linear
in process, checked against hand computations; the 2-rank run that records it through the
trainer into metrics.jsonl, TensorBoard and RUN/fp8_stats.jsonl is
tests/train/test_train_distributed.py (`fsdp_run`)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from train.components.fp8_stats import (
    OPERANDS,
    STATS,
    Fp8Telemetry,
    cast_stats,
    layer_type,
    saturation_bound,
    summarize,
    worst_linears,
)
from train.config import ConfigError, load_config

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _linear(recipe: str, in_features: int = 64, out_features: int = 32):
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name(recipe)
    model = torch.nn.Module()
    model.proj = Float8Linear(in_features, out_features, bias=False, config=config)
    return model


def _fp8(**overrides):
    values = dict(
        enable=True,
        stats_freq=2,
        stats_sample_rows=4,
        stats_underflow_warn=0.01,
        stats_saturation_warn=0.001,
    )
    return types.SimpleNamespace(**(values | overrides))


def _hand_underflow(x: torch.Tensor, scale, dtype) -> float:
    """Share of non-zero elements that are zero after a plain float8 cast of x * scale."""
    casted = (x.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    return ((x != 0) & (casted.float() == 0)).sum().item() / x.numel()


def _row_scales(x: torch.Tensor) -> torch.Tensor:
    """Rowwise e4m3 scales rounded down to a power of 2, by hand."""
    amax = x.abs().amax(dim=-1, keepdim=True).double()
    return torch.exp2(torch.floor(torch.log2(torch.finfo(E4M3).max / amax))).float()


def test_tensorwise_cast_stats_equal_a_hand_computation():
    from torchao.float8.config import CastConfig

    torch.manual_seed(0)
    x = torch.randn(32, 16)
    x[3, 5] = 2000.0  # an outlier: the scale follows it, small values flush to zero
    x[0, :4] = 1e-3  # 1e-3 x 448/2000 is below half e4m3's smallest subnormal (2**-10)
    stats = cast_stats(x, CastConfig(target_dtype=E4M3), round_scales_to_power_of_2=False)
    assert stats.amax.item() == 2000.0
    assert stats.scale.item() == pytest.approx(torch.finfo(E4M3).max / 2000.0, rel=1e-7)
    underflow = (stats.underflow / stats.numel).item()
    assert underflow == pytest.approx(_hand_underflow(x, stats.scale, E4M3)) and underflow > 0
    assert stats.saturation.item() == 0  # the amax element lands on the maximum, unclamped

    # a scale decided elsewhere (the FP8 all-gather's): what it pushes past the range clamps
    y = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    clamped = cast_stats(y, CastConfig(target_dtype=E4M3), False, scale=torch.tensor(224.0))
    assert clamped.saturation.item() == 2  # 3 and 4 -> 672 and 896; 2 -> 448 exactly
    assert saturation_bound(E4M3) == 464.0 and saturation_bound(E5M2) == 57344.0 + 4096.0


def test_rowwise_cast_stats_use_power_of_two_row_scales():
    from torchao.float8.config import CastConfig, ScalingGranularity

    x = torch.tensor([[1.0, 0.5, 1e-6, 0.0], [300.0, 1.0, 0.25, -2.0]])
    rowwise = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=E4M3)
    stats = cast_stats(x, rowwise, round_scales_to_power_of_2=True)
    # row scales 448 -> 256 and 448/300 -> 1 (rounded down to a power of 2); the smallest
    assert stats.amax.item() == 300.0 and stats.scale.item() == 1.0
    # 1e-6 * 256 underflows; the exact zero is not counted; 0.25 * 1 is representable
    assert (stats.underflow / stats.numel).item() == 1 / 8


def test_telemetry_on_one_float8_linear(tmp_path):
    """Only stats steps are hooked; input, weight, grad_output and the GEMM error equal hand
    computations; the warning names the linear; the record lands in RUN/fp8_stats.jsonl."""
    model = _linear("tensorwise")
    warnings: list[str] = []
    telemetry = Fp8Telemetry(_fp8(), [model], str(tmp_path), warnings.append)
    proj = model.proj

    telemetry.begin_step(1)  # not a stats step: nothing is installed, nothing is recorded
    assert not proj._forward_hooks
    proj(torch.randn(8, 64)).sum().backward()
    telemetry.end_step()
    assert telemetry.metrics(1) == {} and not (tmp_path / "fp8_stats.jsonl").exists()

    x = torch.randn(2, 4, 64)
    x[0, 0, 0] = 1e4  # input outlier: ~2% of the input flushes to zero, over the 1% threshold
    telemetry.begin_step(2)
    assert len(proj._forward_hooks) == 1
    out = proj(x)
    (out * 3.0).sum().backward()  # grad_output: all 3
    telemetry.end_step()
    assert not proj._forward_hooks  # hooks gone: validation and later steps run untouched
    summary = telemetry.metrics(2)

    fp8_max = torch.finfo(E4M3).max
    weight = proj.weight.detach()
    assert summary["fp8/proj/input_amax"] == 1e4
    assert summary["fp8/proj/input_scale"] == pytest.approx(fp8_max / 1e4, rel=1e-7)
    assert summary["fp8/proj/input_underflow"] == pytest.approx(
        _hand_underflow(x, fp8_max / 1e4, E4M3)
    )
    assert summary["fp8/proj/weight_amax"] == pytest.approx(weight.abs().max().item())
    assert summary["fp8/proj/weight_scale"] == pytest.approx(
        fp8_max / weight.abs().max().item(), rel=1e-6
    )
    assert summary["fp8/proj/grad_output_amax"] == 3.0  # e5m2 for tensorwise gradients
    assert summary["fp8/proj/grad_output_scale"] == pytest.approx(torch.finfo(E5M2).max / 3.0)
    assert summary["fp8/proj/grad_output_underflow"] == 0.0
    rows = x.reshape(-1, 64)[:4]
    want = rows @ weight.t()
    error = (torch.linalg.vector_norm(out.reshape(-1, 32)[:4] - want) / want.norm()).item()
    assert summary["fp8/proj/gemm_rel_err"] == pytest.approx(error, rel=1e-5)
    assert 0 < error < 0.2
    for key, value in summary.items():
        if key.endswith(("_underflow", "_saturation")):
            assert 0 <= value <= 1, key

    (line,) = warnings  # one line for underflow; nothing saturates
    assert line.startswith("FP8 underflow at step 2: proj input 2.")
    assert "fp8.stats_underflow_warn = 1.000%" in line
    (record,) = [json.loads(row) for row in (tmp_path / "fp8_stats.jsonl").read_text().splitlines()]
    assert record["step"] == 2
    assert record["linears"]["proj"]["input"]["amax"] == 1e4
    assert worst_linears([record], "underflow")[0][1:] == ("proj", "input", 2)


def test_micro_batches_accumulate(tmp_path):
    model = _linear("rowwise")
    warnings: list[str] = []
    telemetry = Fp8Telemetry(
        _fp8(stats_underflow_warn=0.0), [model], str(tmp_path), warnings.append
    )
    telemetry.begin_step(4)
    small, large = torch.randn(4, 64), torch.randn(4, 64)
    large[:, 0] = 1e4  # row scale 2**-5: |x| < 2**-4 flushes to zero (~5% of the row)
    model.proj(small).sum().backward()
    model.proj(large).sum().backward()
    telemetry.end_step()
    summary = telemetry.metrics(4)
    assert summary["fp8/proj/input_amax"] == 1e4  # the max over both micro-batches
    assert summary["fp8/proj/input_scale"] == 2.0**-5  # rowwise: power-of-2 scales
    underflow = summary["fp8/proj/input_underflow"]  # counted over both micro-batches
    expected = (
        _hand_underflow(small, _row_scales(small), E4M3)
        + _hand_underflow(large, _row_scales(large), E4M3)
    ) / 2
    assert underflow == pytest.approx(expected) and underflow > 0.01
    assert len(warnings) == 1 and warnings[0].startswith("FP8 underflow at step 4: proj input")


def test_compiled_blocks_run_no_hooks_so_only_weights_are_measured_and_said(tmp_path):
    """torchtitan compiles each block (fullgraph): a hook traced into it must not break the
    graph (dynamo refuses its side effects), and a compiled block does not call hooks added
    later. The telemetry must neither crash nor pretend: weights only, said in one line."""

    class Block(torch.nn.Module):
        def __init__(self, proj):
            super().__init__()
            self.proj = proj

        def forward(self, x):
            return self.proj(x)

    model = Block(_linear("tensorwise").proj)
    model.compile(backend="aot_eager", fullgraph=True)
    warnings: list[str] = []
    telemetry = Fp8Telemetry(_fp8(), [model], str(tmp_path), warnings.append)
    for step in (2, 3, 4):  # traced on a stats step (hooks on), then called with and without
        telemetry.begin_step(step)
        model(torch.randn(8, 64)).sum().backward()
        telemetry.end_step()
        summary = telemetry.metrics(step)
        weights = [f"fp8/proj/weight_{s}" for s in sorted(STATS)]
        assert sorted(summary) == (weights if step % 2 == 0 else []), step
    assert warnings == [
        "FP8 telemetry: no linear's forward hook ran (blocks compiled by torch.compile do not "
        "call hooks added later): weights measured only"
    ]


def test_layer_types_and_summary():
    assert layer_type("layers.12.attention.qkv_linear.wq") == "attention.qkv_linear.wq"
    assert layer_type("layers.0") == "layers.0" and layer_type("proj") == "proj"
    detail = {
        "layers.0.feed_forward.w1": {
            "input": {"amax": 2.0, "scale": 224.0, "underflow": 0.1, "saturation": 0.0},
            "gemm_rel_err": 0.02,
        },
        "layers.1.feed_forward.w1": {
            "input": {"amax": 4.0, "scale": 112.0, "underflow": 0.3, "saturation": 0.5},
            "gemm_rel_err": 0.04,
        },
    }
    summary = summarize(detail)
    assert summary == {
        "fp8/feed_forward.w1/input_amax": 4.0,
        "fp8/feed_forward.w1/input_scale": 112.0,
        "fp8/feed_forward.w1/input_underflow": 0.3,
        "fp8/feed_forward.w1/input_saturation": 0.5,
        "fp8/feed_forward.w1/gemm_rel_err": pytest.approx(0.03),
    }


@pytest.mark.parametrize(
    "fp8, fragment",
    [
        (
            "stats_freq = 15",
            "fp8.stats_freq (15) must be 0 (off) or a multiple of metrics.log_freq (10)",
        ),
        ("stats_freq = -10", "fp8.stats_freq = -10 must be >= 0"),
        ("stats_underflow_warn = 2.0", "fp8.stats_underflow_warn (2.0) is a share: give 0 to 1"),
        ("stats_sample_rows = 0", "fp8.stats_sample_rows = 0 must be positive"),
    ],
)
def test_bad_stats_keys_are_one_line_errors(tmp_path, fp8, fragment):
    from tests.utils.runs import REPO

    path = tmp_path / "bad.toml"
    path.write_text(
        f'extends = "{REPO}/configs/debug.toml"\n[metrics]\nlog_freq = 10\n[fp8]\n{fp8}\n'
        '[[dataloader.mix]]\npath = "x"\nweight = 1.0\n[validation]\nenable = false\n'
    )
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_telemetry_reports_against_the_maximum_of_the_format(tmp_path):
    """In the fnuz format (AMD MI300X/MI325X) e4m3 ends at 240, not 448: a scale decided
    elsewhere clamps what fn would keep, and a record and its warning name the maximum the
    linear's casts really use (its config drives them: train.fp8.with_fp8_format)."""
    from torchao.float8.config import CastConfig, Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from train.fp8 import with_fp8_format

    fnuz = torch.float8_e4m3fnuz
    assert saturation_bound(fnuz) == 248.0  # 240 plus half the step of 16 at the top
    y = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    scale = torch.tensor(80.0)  # 80, 160, 240, 320: one past fnuz's range, none past fn's
    assert cast_stats(y, CastConfig(target_dtype=fnuz), False, scale=scale).saturation == 1
    assert cast_stats(y, CastConfig(target_dtype=E4M3), False, scale=scale).saturation == 0

    torch.manual_seed(0)
    config = with_fp8_format(Float8LinearConfig.from_recipe_name("tensorwise"), "fnuz")
    model = torch.nn.Module()
    model.proj = Float8Linear(64, 32, bias=False, config=config)
    telemetry = Fp8Telemetry(_fp8(stats_saturation_warn=0.0), [model], str(tmp_path))
    telemetry.begin_step(2)
    x = torch.randn(8, 64)
    model.proj(x).sum().backward()
    telemetry.end_step()
    summary = telemetry.metrics(2)
    assert summary["fp8/proj/input_scale"] == pytest.approx(240.0 / x.abs().max().item(), rel=1e-6)
    (record,) = [json.loads(row) for row in (tmp_path / "fp8_stats.jsonl").read_text().splitlines()]
    maxima = {op: stats["max"] for op, stats in record["linears"]["proj"].items() if op in OPERANDS}
    assert maxima == {"input": 240.0, "weight": 240.0, "grad_output": 57344.0}  # e5m2fnuz


def test_a_saturation_warning_names_the_maximum(tmp_path):
    telemetry = Fp8Telemetry(
        _fp8(), [_linear("tensorwise")], str(tmp_path), (warnings := []).append
    )
    entry = {"saturation": 0.02, "underflow": 0.0, "max": 240.0}
    telemetry._warn(6, {"layers.0.w1": {"input": entry}})
    (line,) = warnings
    assert line.startswith("FP8 saturation at step 6: layers.0.w1 input 2.000% (float8 max 240)")
