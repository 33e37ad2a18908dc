"""Every refusal on the plan path is one line: `python -m train --dry-run` for any GPU kind
of `train.plan.gpu_specs.GPUS` and any FP8 recipe and format either plans (exit 0 or 1)
or exits 2 with one `error: ...` sentence, never an assert or a traceback.

The trace does not depend on the GPU kind (only the timing and the verdict do), so the
tiny model's step is traced once and handed to every plan (`measure` returns it); all the
rest, from the config overrides through the rules to the report, is the CLI's own."""

from __future__ import annotations

import itertools

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
def traced(config):
    from train.config import load_config
    from train.runtime import prepare_runtime

    prepare_runtime()
    run = load_config(config, [])
    return dry_run.measure(dry_run.traced_config(run), 1, True, dry_run.TRACED_LAYERS)


@pytest.mark.parametrize(("kind", "recipe"), list(itertools.product(GPUS, RECIPES)))
def test_a_plan_on_any_gpu_with_any_recipe_plans_or_refuses_in_one_line(
    kind, recipe, config, traced, monkeypatch, capsys
):
    monkeypatch.setattr(dry_run, "measure", lambda *args, **kwargs: traced)
    for fmt in FORMATS:
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
