"""The strict TOML layer: unknown keys and wrong types are refused with the file, the dotted
key and a suggestion; `extends` deep-merges; command-line overrides; every shipped config
loads, round-trips through RUN/config.toml and maps onto torchtitan's Trainer.Config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from train.config import (
    ConfigError,
    RunConfig,
    from_dict,
    load_config,
    parse_override_args,
    save_config,
)
from train.launch_rules import check_launch

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.toml"))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_unknown_key_names_file_dotted_key_and_suggestion(tmp_path):
    cfg = write(
        tmp_path / "bad.toml", f'extends = "{REPO}/configs/debug.toml"\n[training]\nstesp = 3\n'
    )
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    msg = str(e.value)
    assert str(cfg) in msg and "'training.stesp'" in msg and "'training.steps'" in msg


def test_unknown_section_and_nested_list_key(tmp_path):
    cfg = write(tmp_path / "a.toml", "[trainig]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"'trainig'.*did you mean 'training'"):
        load_config(cfg)
    cfg = write(tmp_path / "b.toml", '[[dataloader.mix]]\npath = "x"\nweigth = 2.0\n')
    with pytest.raises(
        ConfigError, match=r"dataloader\.mix\[0\]\.weigth.*'dataloader\.mix\[0\]\.weight'"
    ):
        load_config(cfg)


def test_wrong_type_names_key_and_expected_type(tmp_path):
    cfg = write(
        tmp_path / "bad.toml",
        f'extends = "{REPO}/configs/debug.toml"\n[training]\nsteps = "many"\n',
    )
    with pytest.raises(
        ConfigError, match=r"bad\.toml: key 'training\.steps' must be int, got 'many'"
    ):
        load_config(cfg)
    cfg = write(
        tmp_path / "lit.toml",
        f'extends = "{REPO}/configs/debug.toml"\n[fp8]\nrecipe = "blockwise"\n',
    )
    with pytest.raises(ConfigError, match=r"'fp8\.recipe' must be 'tensorwise' \| 'rowwise'"):
        load_config(cfg)


def test_int_is_accepted_for_float_but_bool_is_not(tmp_path):
    base = f'extends = "{REPO}/configs/debug.toml"\n'
    run = load_config(write(tmp_path / "a.toml", base + "[optimizer]\nlr = 1\n"))
    assert run.optimizer.lr == 1.0 and isinstance(run.optimizer.lr, float)
    with pytest.raises(ConfigError, match="optimizer.lr"):
        load_config(write(tmp_path / "b.toml", base + "[optimizer]\nlr = true\n"))
    # a bool is a Python int: `steps = true` trained one step
    with pytest.raises(ConfigError, match=r"'training\.steps' must be int, got True"):
        load_config(write(tmp_path / "c.toml", base + "[training]\nsteps = true\n"))


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("model.dim", -256, "model.dim = -256 must be positive"),
        ("model.n_layers", 0, "model.n_layers = 0 must be positive"),
        ("model.n_heads", 0, "model.n_heads = 0 must be positive"),  # was a ZeroDivisionError
        ("metrics.log_freq", 0, "metrics.log_freq = 0 must be positive"),
        ("lr_scheduler.warmup_steps", -1, "lr_scheduler.warmup_steps = -1 must be >= 0"),
        ("optimizer.lr", -1e-3, "optimizer.lr = -0.001 must be >= 0"),
        ("dataloader.mix", [{"path": "d", "weight": -1.0}], "dataloader.mix[0].weight = -1.0"),
    ],
)
def test_a_negative_or_zero_size_is_refused_naming_the_key(key, value, fragment):
    """These passed `--check` and reached torch (or trained nothing); -1 stays "derive it"
    where it is the default."""
    with pytest.raises(ConfigError, match=re.escape(f"debug.toml: {fragment}")):
        load_config(REPO / "configs" / "debug.toml", [(key, value)])
    run = load_config(REPO / "configs" / "debug.toml", [("training.global_batch_size", -1)])
    assert run.training.global_batch_size == -1


def test_a_config_that_is_not_utf8_names_the_file(tmp_path):
    bad = tmp_path / "binary.toml"
    bad.write_bytes(b"\xff\xfe[training]\n")
    with pytest.raises(ConfigError, match=r"binary\.toml: not valid TOML \('utf-8' codec"):
        load_config(bad)


def test_extends_deep_merges_relative_to_file_and_detects_cycles(tmp_path):
    (tmp_path / "sub").mkdir()
    write(
        tmp_path / "parent.toml",
        f'extends = "{REPO}/configs/base.toml"\n[model]\ndim = 512\nn_layers = 7\n',
    )
    child = write(
        tmp_path / "sub" / "child.toml", 'extends = "../parent.toml"\n[model]\nn_layers = 9\n'
    )
    run = load_config(child)
    assert (run.model.dim, run.model.n_layers) == (512, 9)  # merged, not replaced
    assert run.model.n_heads == 8  # from base.toml
    write(tmp_path / "x.toml", 'extends = "y.toml"\n')
    write(tmp_path / "y.toml", 'extends = "x.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "x.toml")


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_overrides_both_spellings_and_literal_parsing():
    cfg = REPO / "configs" / "debug.toml"
    run = load_config(
        cfg,
        [
            "--training.steps",
            "20",
            "--set",
            "job.folder=/tmp/x",
            "--fp8.enable=false",
            "--set",
            'fp8.filter_fqns=["lm_head", "w2"]',
            "--job.description",
            "hello world",
        ],
    )
    assert run.training.steps == 20 and run.job.folder == "/tmp/x" and run.fp8.enable is False
    assert run.fp8.filter_fqns == ["lm_head", "w2"] and run.job.description == "hello world"
    with pytest.raises(
        ConfigError, match=r"unknown override key 'training\.stpes'.*'training\.steps'"
    ):
        load_config(cfg, ["--training.stpes", "3"])
    with pytest.raises(ConfigError, match="must be int"):
        load_config(cfg, ["--training.steps", "lots"])
    with pytest.raises(ConfigError, match="unrecognised argument"):
        parse_override_args(["steps=3"])


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_configs_load_and_round_trip(path, tmp_path):
    run = load_config(path)
    save_config(run, tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml") == run
    assert not (tmp_path / "config.toml.tmp").exists()


def _run(**sections) -> RunConfig:
    raw = {"dataloader": {"mix": [{"path": "unused"}]}, "validation": {"enable": False}}
    return from_dict(raw | sections, "test")


def test_launch_degrees_must_multiply_to_the_world_size():
    run = _run(parallelism={"dp_shard": 4, "tp": 2})
    with pytest.raises(ConfigError, match=r"= 8, but the world size is 16"):
        check_launch(run, 16)
    with pytest.raises(ConfigError, match="= 3 does not divide the world size 8"):
        check_launch(_run(parallelism={"tp": 3}), 8)
    with pytest.raises(ConfigError, match="parallelism.dp_shard = 0 must be positive"):
        _run(parallelism={"dp_shard": 0})  # the config's sign rule; -1 is "the rest"
    assert check_launch(_run(parallelism={"tp": 2}), 8)["dp_shard"] == 4
    assert check_launch(run, 8) == {"dp_replicate": 1, "dp_shard": 4, "tp": 2, "cp": 1}


def test_launch_seq_len_must_split_over_sequence_and_context_parallelism():
    heads = {"n_heads": 8, "n_kv_heads": 8}
    run = _run(model=heads, training={"seq_len": 100}, parallelism={"tp": 8})
    with pytest.raises(ConfigError, match=r"training\.seq_len=100 .*tp=8.*use seq_len 96 or 104"):
        check_launch(run, 8)
    # CP shards the document block mask in whole 128-token blocks per rank: 2176 = 17 x 128
    cp = _run(training={"seq_len": 2176}, parallelism={"cp": 2})
    with pytest.raises(
        ConfigError, match=r"128-token mask blocks x parallelism\.cp=2.*2048 or 2304"
    ):
        check_launch(cp, 8)
    # without sequence parallelism TP does not split the sequence
    no_sp = _run(
        model=heads,
        training={"seq_len": 100},
        parallelism={"tp": 8, "enable_sequence_parallel": False},
    )
    assert check_launch(no_sp, 8)["tp"] == 8


def test_launch_tp_must_divide_the_heads():
    run = _run(model={"n_heads": 8, "n_kv_heads": 2}, parallelism={"tp": 4})
    with pytest.raises(ConfigError, match=r"parallelism\.tp=4 must divide .*n_kv_heads=2"):
        check_launch(run, 4)
    assert check_launch(_run(model={"n_heads": 8, "n_kv_heads": 2}, parallelism={"tp": 2}), 4)


def test_70b_config_has_the_llama3_70b_shape_and_fsdp_tp8():
    run = load_config(REPO / "configs" / "llama3_70b_fp8.toml")
    m = run.model
    assert (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_hidden_dim, m.vocab_size) == (
        80,
        8192,
        64,
        8,
        28672,
        128256,
    )
    assert m.rope_theta == 500000 and m.rope_scaling
    assert run.parallelism.tp == 8 and run.parallelism.dp_shard == -1
    assert run.fp8.enable and run.compile.enable and run.compile.async_tp
    assert run.activation_checkpoint.mode in ("selective", "full")


def test_debug_config_is_vllm_cpu_servable():
    run = load_config(REPO / "configs" / "debug.toml")
    assert run.model.head_dim >= 32 and run.fp8.enable and run.model.vocab_size == 2048


def test_cross_field_checks(tmp_path):
    with pytest.raises(ConfigError, match="n_kv_heads"):
        load_config(REPO / "configs" / "debug.toml", [("model.n_kv_heads", 3)])
    with pytest.raises(ConfigError, match="seq_len"):
        load_config(REPO / "configs" / "debug.toml", [("training.seq_len", 4096)])
    assert isinstance(load_config(REPO / "configs" / "debug.toml"), RunConfig)


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("health.spike_warmup", 200, "2 <= spike_warmup <= spike_window"),
        ("health.spike_sigmas", 0, "health.spike_sigmas = 0.0 must be positive"),
        ("health.spike_steps", 0, "health.spike_steps = 0 must be positive"),
        ("health.rollback_lr_factor", 2.0, "rollback_lr_factor in (0, 1] (got 2.0)"),
        ("health.max_rollbacks", -1, "health.max_rollbacks"),
        ("dataloader.skip_sequences", [[8, 4]], "dataloader.skip_sequences[0] = [8, 4]"),
    ],
)
def test_spike_and_skip_keys_are_checked(key, value, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(REPO / "configs" / "debug.toml", [(key, value)])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            [("checkpoint.storage_gb_per_s", 0)],
            "checkpoint.storage_gb_per_s = 0.0 must be positive",
        ),
        (
            [("checkpoint.storage_gb_per_s", 0.3)],
            "min_save_gb_per_s = 0.5 is above checkpoint.storage_gb_per_s = 0.3: every healthy "
            "save would be called a hang; set min_save_gb_per_s to at most 0.3",
        ),
    ],
)
def test_the_storage_rate_is_checked_against_the_save_floor(overrides, fragment):
    """A storage slower than the save's hang floor makes every healthy save a hang."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(REPO / "configs" / "debug.toml", overrides)
    ok = [("checkpoint.storage_gb_per_s", 0.3), ("fault_tolerance.min_save_gb_per_s", 0.2)]
    assert load_config(REPO / "configs" / "debug.toml", ok).checkpoint.storage_gb_per_s == 0.3
