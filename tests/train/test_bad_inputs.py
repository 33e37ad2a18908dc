"""Bad input through the real CLI: one `error: ...` line on stderr naming the thing and the
fix, exit code 2, no traceback."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.utils.runs import check_ok, cli, train_env


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode == 2, (
        f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def test_missing_config_file(tmp_path):
    assert_one_line_error(cli("--config", str(tmp_path / "nope.toml")), "nope.toml", "not found")


def test_unknown_key_with_suggestion(run_toml):
    config = run_toml(training={"stesp": 3})
    assert_one_line_error(
        cli("--config", str(config)),
        str(config),
        "'training.stesp'",
        "did you mean 'training.steps'",
    )


def test_unknown_override_and_wrong_type(run_toml):
    config = run_toml()
    assert_one_line_error(
        cli("--config", str(config), "--optimizer.lrr", "1e-3"), "'optimizer.lrr'", "'optimizer.lr'"
    )
    assert_one_line_error(
        cli("--config", str(config), "--set", "training.steps=many"), "'training.steps'", "int"
    )


def test_parallel_degrees_must_multiply_to_world_size(run_toml):
    config = run_toml()
    proc = cli(
        "--config",
        str(config),
        "--parallelism.dp_shard",
        "2",
        "--parallelism.tp",
        "2",
        env=dict(train_env(), WORLD_SIZE="2"),
    )
    assert_one_line_error(proc, "= 4", "world size is 2")


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["--parallelism.tp", "3"], "does not divide the world size 2"),
        (["--parallelism.tp", "2", "--model.n_kv_heads", "1"], "parallelism.tp=2 must divide"),
        (["--parallelism.tp", "2", "--training.seq_len", "63"], "use seq_len 62 or 64"),
    ],
    ids=["degrees", "heads", "seq_len"],
)
def test_a_launch_and_a_dry_run_refuse_a_bad_layout_with_one_message(run_toml, overrides, fragment):
    """One rule, one message: the real launch stops where --dry-run does, before torchtitan."""
    config = str(run_toml())
    launch = cli("--config", config, *overrides, env=dict(train_env(), WORLD_SIZE="2"))
    dry_run = cli("--config", config, *overrides, "--dry-run", "--world-size", "2")
    assert assert_one_line_error(launch, fragment) == assert_one_line_error(dry_run, fragment)


def test_tokenizer_larger_than_model_vocab(run_toml):
    proc = cli("--config", str(run_toml()), "--model.vocab_size", "1000")
    assert_one_line_error(proc, "model.vocab_size", "1000", "set model.vocab_size >=")


def test_data_prepared_with_another_tokenizer(run_toml, shakespeare_data, tmp_path):
    other = tmp_path / "other_tokenizer"
    shutil.copytree(shakespeare_data / "tokenizer", other)
    tokenizer_json = other / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text() + "\n")  # same vocab, different file
    proc = cli("--config", str(run_toml()), "--dataloader.tokenizer", str(other))
    assert_one_line_error(proc, "manifest.json", "different tokenizer", "re-run dataloader.prepare")


@pytest.mark.slow
def test_checkpoint_from_another_model_shape_and_fresh_guard(run_toml, tmp_path):
    config = run_toml(training={"steps": 1}, validation={"enable": False})
    check_ok(cli("--config", str(config), timeout=300))
    proc = cli(
        "--config",
        str(config),
        "--model.ffn_hidden_dim",
        "512",
        "--training.steps",
        "2",
        timeout=300,
    )
    assert_one_line_error(proc, "step-1", "different model shape", "--fresh --overwrite")

    assert_one_line_error(
        cli("--config", str(config), "--fresh"), "already holds checkpoints", "--overwrite"
    )
    assert_one_line_error(
        cli("--config", str(config), "--overwrite"), "--overwrite only applies with --fresh"
    )
    # --fresh --overwrite starts over: the new model shape trains from step 1
    proc = cli(
        "--config",
        str(config),
        "--fresh",
        "--overwrite",
        "--model.ffn_hidden_dim",
        "512",
        timeout=300,
    )
    check_ok(proc)
    assert "Training starts at step 1" in proc.stdout + proc.stderr


@pytest.mark.parametrize("mode", ["--dry-run", "--check"])
def test_a_world_size_below_one_is_refused_in_one_line(run_toml, mode):
    """`--world-size 0` was read as "not given": the dry run planned this process's world of
    one for half a minute and reported a verdict, the check passed."""
    proc = cli("--config", str(run_toml()), mode, "--world-size", "0")
    assert_one_line_error(proc, "--world-size 0", "at least 1")


def test_a_val_split_smaller_than_one_validation_step_is_refused(run_toml):
    """validation.steps = -1 validates on one pass of the val split; with more sequences in a
    step (local batch x dp) than the pass holds, the loader drops that step on every rank and
    torchtitan's validator asserts on a validation with no batch, at step 1. A launch
    refuses it in one line; a step count (the default) wraps the split and is accepted."""
    config = str(run_toml())
    big = ("--world-size", "8", "--training.local_batch_size", "128")
    big += ("--training.global_batch_size", "-1")
    assert_one_line_error(
        cli("--config", config, "--check", *big, "--validation.steps", "-1"),
        "[[validation.mix]]",
        "one validation step of 1024 sequences (training.local_batch_size 128 x data-parallel",
        "validation.steps to a count",
    )
    check_ok(cli("--config", config, "--check", *big))


@pytest.mark.parametrize(
    "name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"]
)
def test_a_non_integer_rendezvous_variable_is_named(run_toml, name):
    """RANK=x was a traceback (raised again while choosing the rank that prints), WORLD_SIZE=x
    an `invalid literal for int()` naming nothing, LOCAL_RANK=x passed the check."""
    proc = cli("--config", str(run_toml()), "--check", env=dict(train_env(), **{name: "x"}))
    assert_one_line_error(proc, f"environment variable {name}='x' is not an integer")


def test_a_run_folder_under_a_file_is_refused_before_it_is_written(run_toml, tmp_path):
    """It was a NotADirectoryError traceback from the run folder's lease."""
    (tmp_path / "a_file").write_text("")
    config = run_toml(job={"folder": str(tmp_path / "a_file" / "run")})
    proc = cli("--config", str(config), "--check")
    assert_one_line_error(proc, f"{tmp_path / 'a_file'} is not a folder this user can write")


def test_a_tokenizer_json_that_is_not_json_is_named(run_toml, tmp_path):
    """tokenizers raised a bare Exception: a traceback from the launchers' check."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"model": ')
    proc = cli(
        "--config", str(run_toml()), "--check", "--dataloader.tokenizer", str(tmp_path / "tok")
    )
    assert_one_line_error(proc, "tok/tokenizer.json: not a Hugging Face tokenizer.json")


@pytest.mark.parametrize(
    "flags",
    [["--check", "--dry-run"], ["--check", "--write-budgets"], ["--suggest"], ["--write-budgets"]],
)
def test_conflicting_modes_are_refused(run_toml, flags):
    """--check --dry-run checked and exited 0 without a plan; --write-budgets without
    --dry-run was ignored."""
    proc = cli("--config", str(run_toml()), *flags, "--world-size", "2")
    assert_one_line_error(proc, "go with --dry-run", "python -m train --dry-run")
