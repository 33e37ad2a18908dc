"""Export: DCP checkpoint -> HF folder; transformers reproduces torchtitan's logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eval.export import export_checkpoint


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


def test_incomplete_checkpoint_refused(tiny_checkpoint, tmp_path):
    ckpt, source, _ = tiny_checkpoint
    broken = tmp_path / "checkpoint" / "step-9"
    shutil.copytree(ckpt, broken)
    (broken / ".metadata").unlink()
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        export_checkpoint(broken, tmp_path / "hf", source=source)
    assert not (tmp_path / "hf").exists()


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


def test_export_into_checkpoint_folder_refused(tiny_checkpoint):
    ckpt, source, _ = tiny_checkpoint
    with pytest.raises(ValueError, match="inside the run's checkpoint folder"):
        export_checkpoint(ckpt, ckpt.parent / "hf", source=source)
