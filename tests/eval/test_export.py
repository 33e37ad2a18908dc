"""Export: DCP checkpoint -> HF folder; transformers reproduces torchtitan's logits."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from eval.export import ExportSource, export_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _prompts(tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bos = tok.token_to_id("<|begin_of_text|>")
    texts = ["To be, or not to be", "My lord, I", "O Romeo, Romeo! wherefore art thou"]
    return [[bos] + tok.encode(t).ids for t in texts]


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory):
    ckpt, source, model = tiny_checkpoint
    out = tmp_path_factory.mktemp("exp") / "hf"
    export_checkpoint(ckpt, out, source=source)
    return out


def test_export_folder_contents(exported, tiny_checkpoint):
    ckpt, _, _ = tiny_checkpoint
    names = {p.name for p in exported.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "export_info.json",
    } <= names
    assert not [n for n in names if ".tmp" in n]
    info = json.loads((exported / "export_info.json").read_text())
    assert info["step"] == 3 and info["source_checkpoint"] == str(ckpt.resolve())
    config = json.loads((exported / "config.json").read_text())
    assert config["num_key_value_heads"] == 1 and config["head_dim"] == 32
    assert config["rope_scaling"]["rope_type"] == "llama3"
    # vLLM serves min(max_position_embeddings, the tokenizer's model_max_length): the
    # export makes them one (the session's trained tokenizer says 131072, the model 512).
    tok_config = json.loads((exported / "tokenizer_config.json").read_text())
    assert tok_config["model_max_length"] == config["max_position_embeddings"] == 512
    from safetensors import safe_open

    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    # The run's checkpoint folder is only read.
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["step-3"]


def test_transformers_logits_match_torchtitan(exported, tiny_checkpoint, tokenizer_dir):
    from transformers import LlamaForCausalLM

    _, _, model = tiny_checkpoint
    # The export is bf16; compare in fp32 against the torchtitan model with the same
    # bf16-rounded weights so only the architecture mapping is under test.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hf = LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        for ids in _prompts(tokenizer_dir):
            x = torch.tensor([ids])
            want = model(x)
            got = hf(x).logits
            assert want.abs().max() > 1.0  # not a degenerate all-zero comparison
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _cut(path: Path, keep: int = 64) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda step: (step / ".metadata").unlink(), "incomplete checkpoint"),
        # were an UnpicklingError and DCP's CheckpointException (a BaseException) tracebacks
        (lambda step: _cut(step / ".metadata"), "damaged checkpoint.*UnpicklingError"),
        (lambda step: [_cut(f) for f in step.glob("*.distcp")], "damaged checkpoint.*EOFError"),
    ],
    ids=["no-metadata", "torn-metadata", "torn-distcp"],
)
def test_incomplete_or_torn_checkpoint_refused(tiny_checkpoint, tmp_path, damage, message):
    ckpt, source, _ = tiny_checkpoint
    broken = tmp_path / "checkpoint" / "step-9"
    shutil.copytree(ckpt, broken)
    damage(broken)
    with pytest.raises(ValueError, match=message):
        export_checkpoint(broken, tmp_path / "hf", source=source)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]  # no model, no tmp left


def test_existing_model_refused_unless_force(tiny_checkpoint, exported, tmp_path):
    ckpt, source, _ = tiny_checkpoint
    target = tmp_path / "hf"
    shutil.copytree(exported, target)
    (target / "export_info.json").write_text(json.dumps({"source_checkpoint": "/other/step-1"}))
    with pytest.raises(ValueError, match="already holds an export of /other/step-1"):
        export_checkpoint(ckpt, target, source=source)
    export_checkpoint(ckpt, target, source=source, force=True)
    info = json.loads((target / "export_info.json").read_text())
    assert info["source_checkpoint"] == str(ckpt.resolve())
    assert not [p for p in tmp_path.iterdir() if p.name != "hf"]  # no tmp/old leftovers


def test_export_under_a_file_refused_before_any_read(tiny_checkpoint, tmp_path):
    """It was a FileExistsError traceback from the temp folder's mkdir."""
    ckpt, source, _ = tiny_checkpoint
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="a_file is not a folder this user can write"):
        export_checkpoint(ckpt, tmp_path / "a_file" / "hf", source=source)


def test_export_into_checkpoint_folder_refused(tiny_checkpoint):
    ckpt, source, _ = tiny_checkpoint
    with pytest.raises(ValueError, match="inside the run's checkpoint folder"):
        export_checkpoint(ckpt, ckpt.parent / "hf", source=source)


# --- sharded export ---------------------------------------------------------------------


def _logits(folder, tokenizer_dir):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits for ids in _prompts(tokenizer_dir)]


def test_sharded_export_equals_single_file(tiny_checkpoint, exported, tokenizer_dir, tmp_path):
    from safetensors import safe_open

    ckpt, source, _ = tiny_checkpoint
    limit = 100_000
    sharded = export_checkpoint(ckpt, tmp_path / "hf", source=source, max_shard_size="100KB")
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) >= 4 and "model.safetensors" not in files
    assert files == [
        f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)
    ]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    total = 0
    with safe_open(str(exported / "model.safetensors"), "pt") as single:
        want = {k: single.get_tensor(k) for k in single.keys()}
    assert set(index["weight_map"]) == set(want)
    for name in files:
        with safe_open(str(sharded / name), "pt") as f:
            keys = list(f.keys())
            assert {index["weight_map"][k] for k in keys} == {name}
            size = sum(f.get_tensor(k).nbytes for k in keys)
            assert size <= limit or len(keys) == 1, (name, size)  # one big tensor: own file
            for k in keys:
                assert torch.equal(f.get_tensor(k), want[k]), k
            total += size
    assert index["metadata"]["total_size"] == total
    assert json.loads((sharded / "export_info.json").read_text())["num_shards"] == len(files)
    for got, single_file in zip(
        _logits(sharded, tokenizer_dir), _logits(exported, tokenizer_dir), strict=True
    ):
        assert torch.equal(got, single_file)


@pytest.mark.parametrize("size", ["0", "-5GB", "5 parsecs", "GB"])
def test_bad_max_shard_size_is_one_line(tiny_checkpoint, tmp_path, size, capsys):
    from eval.export import main

    ckpt, _, _ = tiny_checkpoint
    argv = ["--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), f"--max-shard-size={size}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-shard-size" in err[0] and "5GB" in err[0], err
    assert not (tmp_path / "hf").exists()


# --- config.json: every shipped config loads without a warning ------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def no_warnings(*loggers: str):
    """Python warnings become errors; WARNING log records of `loggers` fail the test."""
    handler = _Records()
    for name in loggers:
        logging.getLogger(name).addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(handler)
    assert not handler.records, [f"{r.name}: {r.getMessage()}" for r in handler.records]


def test_export_loads_in_transformers_without_warnings(exported):
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    with no_warnings("transformers"):
        AutoConfig.from_pretrained(exported)
        AutoTokenizer.from_pretrained(exported)
        LlamaForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)


SHIPPED_CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def _shipped_hf_folder(toml: Path, tokenizer_dir: Path, out: Path) -> tuple[Path, object]:
    """config.json + tokenizer (no weights) as eval.export writes them for `toml`."""
    from common.io import write_json_atomic
    from eval.export import hf_config, write_tokenizer_files
    from train.config import load_config
    from train.model import build_model_spec

    run = load_config(toml)
    model_config = build_model_spec(run).model
    source = ExportSource(model_config, tokenizer_dir, run.model.max_seq_len)
    out.mkdir(parents=True)
    write_json_atomic(out / "config.json", hf_config(source))
    write_tokenizer_files(tokenizer_dir, out, run.model.max_seq_len)
    return out, model_config


@pytest.mark.parametrize("toml", SHIPPED_CONFIGS, ids=[p.stem for p in SHIPPED_CONFIGS])
def test_shipped_config_json_is_clean_and_exact(toml, tokenizer_dir, tmp_path):
    """transformers accepts each shipped config's config.json without a warning, and its
    RoPE frequencies are torchtitan's (the llama3 fields may be rescaled to fit a short
    max_position_embeddings; the frequencies must not move)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder, model_config = _shipped_hf_folder(toml, tokenizer_dir, tmp_path / "hf")
    with no_warnings("transformers"):
        config = AutoConfig.from_pretrained(folder)
    rope = model_config.layers[0].attention.rope
    rope_type = config.rope_parameters["rope_type"]
    assert rope_type == ("llama3" if rope.scaling == "llama" else "default")
    if rope_type == "llama3":
        assert config.rope_parameters["original_max_position_embeddings"] < (
            config.max_position_embeddings
        )
    assert config.max_position_embeddings == load_config_max_seq_len(toml)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    short = dataclasses.replace(rope, max_seq_len=2)
    titan = short.build()._precompute_cache()[1].angle()  # position 1: the frequencies
    torch.testing.assert_close(hf_inv_freq.float(), titan, rtol=1e-6, atol=0)
    if rope_type == "llama3":  # the rescaled fields give torchtitan bit-identical freqs
        p = config.rope_parameters
        rescaled = dataclasses.replace(
            short,
            original_max_position_embeddings=p["original_max_position_embeddings"],
            low_freq_factor=p["low_freq_factor"],
            high_freq_factor=p["high_freq_factor"],
        )
        assert torch.equal(rescaled.build()._precompute_cache(), short.build()._precompute_cache())


def load_config_max_seq_len(toml: Path) -> int:
    from train.config import load_config

    return load_config(toml).model.max_seq_len


@pytest.mark.slow
def test_shipped_config_json_accepted_by_vllm(tokenizer_dir, tmp_path):
    """vLLM's own config parsing (ModelConfig: architecture, RoPE, max_model_len) takes
    every shipped config's config.json without a warning."""
    from vllm.config import ModelConfig

    for toml in SHIPPED_CONFIGS:
        folder, _ = _shipped_hf_folder(toml, tokenizer_dir, tmp_path / toml.stem)
        with no_warnings("vllm", "transformers"):
            config = ModelConfig(model=str(folder), tokenizer=str(folder), dtype="bfloat16")
        assert config.max_model_len == load_config_max_seq_len(toml), toml


# --- crash safety -------------------------------------------------------------------------

_EXPORT_TINY = """
import sys
import time
from pathlib import Path
sys.path.insert(0, {repo!r})
import safetensors.torch
from tests.utils.tiny_model import tiny_model_config
# Hold the export before its second shard (the first one written), so the kill lands between
# real shards whatever the machine's speed, instead of racing a poll against the writes.
real_save_file = safetensors.torch.save_file
shards_written = []
def holding_save_file(tensors, filename, *args, **kwargs):
    if shards_written:
        Path({held!r}).touch()
        time.sleep(3600)
    real_save_file(tensors, filename, *args, **kwargs)
    shards_written.append(filename)
safetensors.torch.save_file = holding_save_file
from eval.export import ExportSource, export_checkpoint
source = ExportSource(tiny_model_config({vocab}), Path({tok!r}), 512)
export_checkpoint(Path({ckpt!r}), Path({out!r}), source=source, max_shard_size=1)
"""


def test_kill_mid_export_leaves_no_model(tiny_checkpoint, tokenizer_dir, tmp_path):
    """A real SIGKILL between shards: no `out`, nothing loadable, and the next export
    removes the dead one's temp folder."""
    ckpt, source, _ = tiny_checkpoint
    out = tmp_path / "hf"
    held = tmp_path.parent / f"{tmp_path.name}-export-held"  # outside the folder inspected below
    code = _EXPORT_TINY.format(
        repo=str(REPO),
        vocab=source.model_config.vocab_size,
        tok=str(tokenizer_dir),
        ckpt=str(ckpt),
        out=str(out),
        held=str(held),
    )
    # 1-byte shards: one file per tensor, so the kill lands between real shards.
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 300
    while not held.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL

    assert not out.exists()
    (leftover,) = tmp_path.iterdir()  # the dead export's temp folder, named as such
    assert leftover.name.startswith(f"hf.tmp-{proc.pid}-")
    assert list(leftover.glob("model-*.safetensors"))
    assert not (leftover / "config.json").exists()  # config.json is written last
    from transformers import AutoConfig

    with pytest.raises((OSError, ValueError)):  # "Unrecognized model": no config.json
        AutoConfig.from_pretrained(leftover)

    export_checkpoint(ckpt, out, source=source, max_shard_size="100KB")
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()


@pytest.mark.slow  # 73 s on 2 loaded cores: lm-eval, transformers and torch imported anew
def test_lm_eval_runs_an_export_in_process(exported, tmp_path):
    """lm-eval's usual in-process path, `lm_eval --model hf`, on an export, in the
    project's venv: the `lm-eval` extra installs what it needs (accelerate); one shipped task
    (eval/lm_eval_tasks), two documents."""
    lm_eval = Path(sys.executable).with_name("lm_eval")
    proc = subprocess.run(
        [str(lm_eval), "--model", "hf", "--model_args", f"pretrained={exported},dtype=float32"]
        + ["--tasks", "shakespeare_next_line", "--include_path", str(REPO / "eval" / "lm_eval_tasks")]
        + ["--limit", "2", "--device", "cpu", "--batch_size", "1"]
        + ["--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "|shakespeare_next_line|" in proc.stdout.replace(" ", ""), proc.stdout[-3000:]
