"""Which linears an FP8 config converts, and the refusal of one that converts none.

- `test_auto_filter_converts_what_torchao_chooses_on_the_8b_spec`: the shipped 8B config
  with `fp8.auto_filter_small_kn` on converts exactly the linears torchao's own rule
  (`_auto_filter_for_recipe`) picks when asked about the real `nn.Linear` modules of the
  model (built on the meta device): 160 of its 225, not 0 (torchtitan 0.3.0 hands the rule
  a `Linear.Config`, which it rejects, so before `train.fp8.size_filter` nothing converted).
- `test_fp8_converting_nothing_is_refused_through_python_m_train`: the debug model (dim
  256, below every torchao threshold) with the flag on: `python -m train` stops at start-up
  with one line naming the keys and the fix; `fp8.allow_no_conversion` accepts it.
"""

from __future__ import annotations

import pytest

from tests.train.test_bad_inputs import assert_one_line_error
from tests.utils.runs import REPO, cli


def _float8_and_plain_linears(model_config) -> tuple[set[str], set[str]]:
    """(names of Float8Linear modules, names of the other nn.Linear modules) of
    `model_config` built on the meta device: what the model really holds."""
    import torch
    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        model = model_config.build()
    fp8, plain = set(), set()
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            fp8.add(name)
        elif isinstance(module, torch.nn.Linear):
            plain.add(name)
    return fp8, plain


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_auto_filter_converts_what_torchao_chooses_on_the_8b_spec(recipe):
    import torch
    from torchao.float8 import _auto_filter_for_recipe

    from train.config import load_config
    from train.model import build_model_config, build_model_spec

    run = load_config(
        REPO / "configs" / "llama3_8b_fp8.toml",
        [("fp8.auto_filter_small_kn", True), ("fp8.recipe", recipe)],
    )
    # torchao's rule over the real modules of the unconverted model
    rule = _auto_filter_for_recipe(recipe, filter_fqns=list(run.fp8.filter_fqns))
    with torch.device("meta"):
        plain_model = build_model_config(run, "flex").build()
    linears = {
        name: module
        for name, module in plain_model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    expected = {name for name, module in linears.items() if rule(module, name)}
    # 32 layers x (wq, wo, w1, w2, w3); wk and wv (4096 -> 1024) are below the thresholds
    # and lm_head is filtered by name
    assert len(linears) == 225 and len(expected) == 160

    converted, kept = _float8_and_plain_linears(build_model_spec(run, "flex").model)
    assert converted == expected
    assert kept == set(linears) - expected


def test_fp8_converting_nothing_is_refused_through_python_m_train(run_toml):
    from train.build import to_trainer_config
    from train.config import load_config
    from train.fp8 import check_fp8_converts

    config = run_toml(fp8={"enable": True, "auto_filter_small_kn": True})
    assert_one_line_error(
        cli("--config", str(config)),
        "fp8.enable = true but no linear of the model is converted",
        "fp8.auto_filter_small_kn = true",
        "fp8.allow_no_conversion = true",
    )
    # said to be intended: accepted, and it converts nothing (the log says "FP8: off")
    run = load_config(config, [("fp8.allow_no_conversion", True)])
    spec = to_trainer_config(run, world_size=1, accelerator=False).model_spec
    assert check_fp8_converts(run, spec.model) == 0
    assert _float8_and_plain_linears(spec.model)[0] == set()
    # the debug model without the size filter: every linear but lm_head
    run = load_config(config, [("fp8.auto_filter_small_kn", False)])
    spec = to_trainer_config(run, world_size=1, accelerator=False).model_spec
    assert check_fp8_converts(run, spec.model) > 0
    assert len(_float8_and_plain_linears(spec.model)[0]) == run.model.n_layers * 7


def test_size_filter_for_a_recipe_torchao_has_no_thresholds_for():
    from train.fp8 import size_filter

    with pytest.raises(ValueError, match="fp8.auto_filter_small_kn: torchao has no size"):
        size_filter("rowwise_with_gw_hp", ["lm_head"])
