"""Every refusal on the plan path is one line: `python -m train --dry-run` for any GPU kind
of `train.plan.gpu_specs.GPUS` and any FP8 recipe and format either plans (exit 0 or 1)
or exits 2 with one `error: ...` sentence, never an assert or a traceback.

The trace does not depend on the GPU kind (only the timing and the verdict do), and the
refusals come before it, so every plan gets one step's counts made by hand (`measure`
returns them); all the rest, from the config overrides through the rules to the report,
is the CLI's own."""

from __future__ import annotations

import pytest

from tests.utils.tiny_model import TINY_TRAIN_MODEL_4_HEADS
from train.__main__ import main
from train.plan import dry_run
from train.plan.gpu_specs import GPUS

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
FORMATS = ("auto", "fn", "fnuz")


def _refused(kind: str, recipe: str, fmt: str) -> str:
    """What the GPU cannot train (a fragment of the sentence), or "" when it plans."""
    arch = GPUS[kind].arch
    if arch.startswith("sm") and int(arch[2:]) < 89:
        return "has no FP8 GEMMs"
    if recipe == "mxfp8":
        return "fp8.recipe = 'mxfp8'"
    own = "fnuz" if GPUS[kind].fp8_format.endswith("fnuz") else "fn"
    if arch and fmt not in ("auto", own):
        return f"fp8.format = '{fmt}'"
    return ""


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("refusals")
    model = "\n".join(f"{k} = {v}" for k, v in TINY_TRAIN_MODEL_4_HEADS.items())
    path = folder / "tiny.toml"
    path.write_text(
        f'[job]\nfolder = "{folder / "run"}"\n[model]\n{model}\nvocab_size = 512\n'
        'max_seq_len = 64\n[dataloader]\n[[dataloader.mix]]\npath = "unused"\n'
        "[validation]\nenable = false\n[training]\nseq_len = 64\nlocal_batch_size = 1\n"
        '[fp8]\nenable = true\nrecipe = "tensorwise"\n'
    )
    return str(path)


@pytest.fixture(scope="module")
def traced():
    """A step's counts made by hand (what the report and the time model read)."""
    import dataclasses

    from train.plan.step_counts import GIB, OpCounts, StepCounts

    ints = {f.name: GIB for f in dataclasses.fields(StepCounts) if f.type == "int"}
    ints.update(layers=2, accumulation=1, num_flops_per_token=6 * 10**6)
    micro = OpCounts(flops={"gemm float8": 10**12, "attention": 10**11}, memory_bytes={"x": 10**9})
    return StepCounts(**ints, groups={}, micro=micro, once=OpCounts())


# every recipe in the GPU's own format, and each forced format once
CASES = [(recipe, "auto") for recipe in RECIPES] + [("tensorwise", fmt) for fmt in FORMATS[1:]]


@pytest.mark.parametrize("kind", list(GPUS))
def test_a_plan_on_any_gpu_with_any_recipe_plans_or_refuses_in_one_line(
    kind, config, traced, monkeypatch, capsys
):
    monkeypatch.setattr(dry_run, "measure", lambda *args, **kwargs: traced)
    for recipe, fmt in CASES:
        argv = ["--config", config, "--dry-run", "--world-size", "1", "--gpu", kind,
                "--fp8.recipe", recipe, "--fp8.format", fmt]  # fmt: skip
        code = main(argv)
        out, err = capsys.readouterr()
        why = _refused(kind, recipe, fmt)
        if why:
            assert code == 2 and out == "", (kind, recipe, fmt, out)
            assert err.count("\n") == 1 and err.startswith("error: ") and why in err, err
        else:
            assert code in (0, 1) and "Traceback" not in err, (kind, recipe, fmt, err)
            assert "reserved peak" in out, out
