"""common.io: atomic writes leave the old file or the new one, torn JSONL lines are counted,
user errors are one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.io import (
    append_jsonl,
    atomic_path,
    read_jsonl,
    run_cli,
    write_json_atomic,
    write_jsonl_atomic,
)


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "state.json"
    write_json_atomic(path, {"step": 1})
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text('{"step": ')  # killed half-way
        raise RuntimeError("killed")
    assert json.loads(path.read_text()) == {"step": 1}
    write_json_atomic(path, {"step": 2})
    assert json.loads(path.read_text()) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_jsonl_round_trip_counts_a_torn_line(tmp_path):
    path = tmp_path / "sub" / "log.jsonl"
    append_jsonl(path, {"step": 1})
    with path.open("a") as fh:
        fh.write('{"step": 2, "lo')  # a kill mid-append, then the resume appends again
    append_jsonl(path, {"step": 2})  # ends the torn line first: not joined to it
    assert read_jsonl(path) == ([{"step": 1}, {"step": 2}], 1)
    write_jsonl_atomic(path, [{"a": 1}, {"b": 2}])
    assert read_jsonl(path) == ([{"a": 1}, {"b": 2}], 0)


def test_run_cli_turns_a_user_error_into_one_line(capsys):
    def bad():
        raise ValueError("x.toml: unknown key 'foo'; did you mean 'food'?")

    assert run_cli(bad) == 2
    assert capsys.readouterr().err == "error: x.toml: unknown key 'foo'; did you mean 'food'?\n"
    assert run_cli(lambda: 3) == 3
    assert run_cli(lambda: None) == 0
    with pytest.raises(KeyError):  # a bug keeps its traceback
        run_cli(lambda: {}["missing"])


@pytest.mark.parametrize(
    "act",
    [
        lambda f: (f / "sub").mkdir(parents=True),  # --out under a file: NotADirectoryError
        lambda f: (f / "x.json").write_text("{}"),
        lambda f: open(f.parent, "w"),  # IsADirectoryError
    ],
    ids=["mkdir", "write", "open-dir"],
)
def test_run_cli_turns_an_os_error_on_a_path_into_one_line(tmp_path, capsys, act):
    """An --out that lies under a file was a NotADirectoryError traceback in every command."""
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("")
    assert run_cli(lambda: act(in_the_way)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}") and err.endswith(
        "check that path and its folders\n"
    )
    assert err.count("\n") == 1
    with pytest.raises(ConnectionError):  # no path: not ours to name, keeps its traceback
        run_cli(lambda: (_ for _ in ()).throw(ConnectionError("reset")))


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "train", "--world-size", "x"],
        ["-m", "dataloader.prepare", "--input", "a", "--out", "b", "--no-such-flag"],
        ["-m", "train.ledger", "verify"],
        ["-m", "eval", "--server", "http://127.0.0.1:1", "--concurrency", "x"],
        ["-m", "eval.serve"],
        ["scripts/slurm/submit.py", "--nodes", "x"],
        ["scripts/replica_groups.py", "--groups", "x", "c.toml"],
    ],
    ids=lambda argv: argv[1] if argv[0] == "-m" else argv[0],
)
def test_a_flag_argparse_refuses_is_one_line_naming_the_help(argv):
    """argparse printed its usage, then the error: two lines. `common.io.ArgumentParser`
    prints the one `error:` line every entry point keeps, naming the flag and `--help`."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, *argv], cwd=repo, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: ") and line.endswith("--help lists the flags"), line
