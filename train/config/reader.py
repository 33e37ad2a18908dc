"""The run config's reader: a TOML file, its `extends` chain and the command-line overrides,
strictly into the `RunConfig` of `train.config.schema`; and the resolved config written
back (`save_config`: `RUN/config.toml`, which export, eval, a resume and the ledger's
verifier read through `load_config`).

How:
1. `tomllib` reads the file; `extends = "base.toml"` (relative to the file) is loaded first
   and deep-merged under it (tables merge key by key, everything else is replaced; cycles
   are an error).
2. Command-line overrides (`--training.steps 20`, `--set training.steps=20`) are applied to
   the merged dict; values are TOML literals (`20`, `true`, `"x"`, `[1, 2]`), anything that
   does not parse as one is taken as a string.
3. Unknown keys are found by walking the dict against the dataclass tree (so the message can
   give the dotted path and a difflib suggestion), then `dacite` in strict mode builds
   `RunConfig` and checks every type.
   `validate` (`train.config.schema.validate`) then checks the cross-field rules.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import dacite
import tomli_w

from common.io import write_text_atomic
from train.config.schema import ConfigError, RunConfig, validate


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found: check the path given to --config")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML ({e}); fix the file") from None


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _load_with_extends(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"{path}: 'extends' forms a cycle ({cycle}); remove one link")
    raw = _read_toml(path)
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: 'extends' must be a file name string, got {parent!r}")
    return _deep_merge(_load_with_extends(path.parent / parent, (*chain, path)), raw)


def parse_value(text: str) -> Any:
    """A command-line value as a TOML literal (`20`, `true`, `[1, 2]`), else the string."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def parse_override_args(args: Sequence[str]) -> list[tuple[str, Any]]:
    """`--a.b 1`, `--a.b=1` and `--set a.b=1` into (dotted key, value) pairs."""
    overrides: list[tuple[str, Any]] = []
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--set" or arg.startswith("--set="):
            # KEY=VALUE is the next argument, or after "--set="
            pair = (rest.pop(0) if rest else "") if arg == "--set" else arg[len("--set=") :]
            if "=" not in pair:
                raise ConfigError("--set needs KEY=VALUE, e.g. --set training.steps=20")
            key, _, value = pair.partition("=")
            key = key.strip()
        elif arg.startswith("--") and "." in arg.split("=", 1)[0]:
            key, equals, value = arg[2:].partition("=")
            if not equals:
                if not rest:
                    raise ConfigError(f"override {arg} needs a value, e.g. {arg} 20")
                value = rest.pop(0)
        else:
            raise ConfigError(
                f"unrecognised argument {arg!r}: overrides look like --section.key VALUE "
                "or --set section.key=VALUE"
            )
        overrides.append((key, parse_value(value)))
    return overrides


def _apply_override(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: '{part}' is not a table")
        node = child
    node[parts[-1]] = value


def _check_keys(raw: dict[str, Any], cls: type, prefix: str, source: str) -> None:
    """Unknown keys, with the dotted path and the closest valid key."""
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = (
                f"did you mean '{prefix}{close[0]}'?"
                if close
                else f"valid keys: {', '.join(valid)}"
            )
            raise ConfigError(f"{source}: unknown key '{dotted}'; {hint}")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            _check_keys(value, hints[key], f"{dotted}.", source)
        item = typing.get_args(hints[key])[0] if typing.get_origin(hints[key]) is list else None
        if dataclasses.is_dataclass(item) and isinstance(value, list):
            for index, element in enumerate(value):
                if isinstance(element, dict):
                    _check_keys(element, item, f"{dotted}[{index}].", source)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _number(tp: type) -> Any:
    """dacite's hook for `tp`: TOML writes `lr = 3` as an int, which a float field takes;
    a bool is a Python int, which neither takes (`steps = true` would train 1 step)."""

    def hook(value: Any) -> Any:
        if isinstance(value, bool) or (tp is float and not isinstance(value, int | float)):
            raise dacite.WrongTypeError(field_type=tp, value=value)
        return float(value) if tp is float else value

    return hook


def from_dict(raw: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Strictly build a RunConfig from a plain dict (the merged TOML)."""
    _check_keys(raw, RunConfig, "", source)
    try:
        run = dacite.from_dict(
            RunConfig,
            raw,
            config=dacite.Config(
                strict=True, type_hooks={float: _number(float), int: _number(int)}
            ),
        )
    except dacite.WrongTypeError as e:
        raise ConfigError(
            f"{source}: key '{e.field_path}' must be {_type_name(e.field_type)}, got {e.value!r}"
        ) from None
    except dacite.MissingValueError as e:
        raise ConfigError(f"{source}: key '{e.field_path}' is required") from None
    except dacite.DaciteError as e:
        raise ConfigError(f"{source}: {e}") from None
    validate(run, source)
    return run


def load_config(
    path: str | os.PathLike, overrides: Iterable[tuple[str, Any]] | Sequence[str] = ()
) -> RunConfig:
    """Read a run TOML (following `extends`), apply overrides, strictly build RunConfig.

    `overrides` is either (dotted key, value) pairs or raw command-line strings
    (`["--training.steps", "20", "--set", "job.folder=x"]`).
    """
    path = Path(path)
    raw = _load_with_extends(path)
    overrides = list(overrides)
    if overrides and isinstance(overrides[0], str):
        overrides = parse_override_args(overrides)
    for dotted, value in overrides:
        alone: dict[str, Any] = {}
        _apply_override(alone, dotted, value)
        try:
            _check_keys(alone, RunConfig, "", "command line")
        except ConfigError as e:
            raise ConfigError(str(e).replace("unknown key", "unknown override key")) from None
        _apply_override(raw, dotted, value)
    return from_dict(raw, str(path))


def save_config(run: RunConfig, path: str | os.PathLike) -> None:
    """Write the resolved config atomically (tmp + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# Fully resolved run config, written by `python -m train`. Loadable by\n"
        "# train.config.load_config; `python -m train --config` this file resumes the run.\n"
    )
    write_text_atomic(path, header + tomli_w.dumps(dataclasses.asdict(run)))
