"""Spike forensics (train/forensics/): the replay names the documents that spiked, by
dataset, token range, source file and record, reaches the spike's weights exactly, and a
quarantine keeps them out of every later epoch.

One session fixture makes a run with a known culprit (`poisoned_run`):
- a corpus of short documents over a dozen words, with four poisoned documents of random
  CJK characters (byte tokens the model learns to find unlikely within a few steps);
- the run planned as a user plans one (`python -m train --dry-run --write-budgets`: its
  RUN/budgets.json, fingerprinted on 2 ranks at context parallel 2);
- a 2-rank run of a tiny model at cp 2 (checkpoints every 3 steps, keep_last 2) whose
  step 9 holds poisoned windows (the shuffle seed is chosen from the loader's own order so
  that it does), where an injected spike ("spike sequences=32-35 factor=10", keyed to step
  9's global sequences) rolls it back to step 6; it then finishes at step 13. Its saves at
  9 and 12 would purge checkpoint 6 under keep_last 2, but the unresolved incident rolled
  back to it, so it stays;
- `python -m train.forensics RUN --incident 1 --quarantine-top K --parallelism.cp 1` on ONE
  process (the run had two, at cp 2: DCP reshards, gradient accumulation takes the second
  rank's rows, and a row is scored on one rank), K the number of poisoned documents in
  step 9. It neither reads nor writes RUN/budgets.json, and the run's next `--check` on its
  own layout passes;
- a 2-rank resume (the run's own layout and budgets) for as many steps as it takes the
  loader's order to bring a quarantined document back (the next epoch), past a save that
  purges checkpoint 6 now that its incident has a report.

The assertions take a run folder and the poisoned documents' identities (`Poisoned`), so
they can be pointed at any run that spiked over known documents:
- `assert_names_poisoned`: the report's top-ranked documents are exactly the poisoned
  ones of the spiking step, with their token ranges, and every ranked and quarantined
  document's source file and record hold its text (`assert_sources_hold_the_documents`);
- `assert_replay_matches_run`: each replayed step's loss equals the run's (metrics.jsonl)
  within fp32 tolerance, like with like: both are what the trainer logs, the injected x10
  included; and the model's own per-token losses, times the factor of their micro-batch,
  give that number again (so the ranked losses are the spike's);
- `assert_quarantined_not_trained`: the resume read the quarantine and passed over the
  poisoned windows the order brought back (its metrics), and the loader rebuilt in-process
  for the same stream (the rollback's skip range from the start, the quarantine from the
  resume point) yields no window overlapping a poisoned document where the plain order
  does, with the same count as the real resume; and the run's data ledger verifies, the
  resume recomputed with the quarantine in force (`python -m train.ledger verify`).

Time (2 shared cores): the fixture's plan, three launches and check ~90 s; everything else
is in-process.
"""

from __future__ import annotations

import io
import json
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import train.ledger.__main__ as ledger_command
from common.run_layout import forensics_report
from tests.utils.runs import (
    PYTHON,
    REPO,
    check_ok,
    cli,
    complete_steps,
    read_metrics,
    run_config,
    torchrun,
    train_env,
    write_config,
)

TINY_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden_dim": 128}
SEQ_LEN, GLOBAL_BATCH = 256, 4  # cp 2: torch's CP block mask needs cp x 128 | seq_len
SPIKE_STEP, CHECKPOINT_INTERVAL, STEPS = 9, 3, 13
ROLLED_BACK_TO = 6  # the checkpoint before the spike
SPIKE = (
    f"spike sequences={(SPIKE_STEP - 1) * GLOBAL_BATCH}-{SPIKE_STEP * GLOBAL_BATCH - 1} factor=10"
)
MIN_TOKENS = 8  # train.forensics' default: a document ranks with this many tokens in the step
POISON_IN_STEP = 16  # a poisoned document counts as in the step with this many tokens there
# fp32: 2 ranks at cp 2 vs 1 rank at cp 1, three steps of FP8 training (cp 2 vs unsharded
# training agree to 1e-5 too, tests/train/test_context_parallel.py)
REPLAY_RTOL = 1e-5
WORDS = "the king and queen of our land shall see my lord good night".split()


@dataclass(frozen=True)
class Poisoned:
    """A poisoned document: its dataset (the mix entry's path), index and token range."""

    dataset: str
    document: int
    tokens: tuple[int, int]


def write_corpus(path: Path, num_documents: int = 320, poisoned=(44, 116, 188, 260)) -> list[int]:
    """A jsonl corpus; returns the poisoned documents' indices (one document per line)."""
    rng = random.Random(0)
    docs = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 40)))
        for _ in range(num_documents)
    ]
    for index in poisoned:
        docs[index] = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(40))
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return list(poisoned)


def loader_for(data: Path, seed: int, skip=()):
    """The run's stream on one rank: a round is a step's GLOBAL_BATCH sequences."""
    from dataloader import MixEntry, TokenShardDataLoader

    config = TokenShardDataLoader.Config(
        mix=[MixEntry(str(data), 1.0)],
        seed=seed,
        prefetch=0,
        skip_sequences=[list(r) for r in skip],
    )
    return config.build(
        dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=SEQ_LEN, local_batch_size=GLOBAL_BATCH
    )


def overlapping(origins, poisoned: list[Poisoned]) -> dict[Poisoned, int]:
    """Per poisoned document, how many of its tokens the rows' windows predict."""
    found: dict[Poisoned, int] = {}
    for _, _, start in origins:
        for p in poisoned:
            a, b = p.tokens
            count = min(b, start + SEQ_LEN + 1) - max(a, start + 1)
            if count > 0:
                found[p] = found.get(p, 0) + count
    return found


def choose_seed(data: Path, poisoned: list[Poisoned]) -> tuple[int, list[Poisoned]]:
    """The first shuffle seed whose step SPIKE_STEP holds a poisoned document with at least
    POISON_IN_STEP tokens; (seed, the poisoned documents of that step)."""
    for seed in range(50):
        loader = loader_for(data, seed)
        for _ in range(SPIKE_STEP):
            next(loader)
        hits = overlapping(loader.last_origins, poisoned)
        # each poisoned document of the step is either clearly in it or absent
        if hits and all(n >= POISON_IN_STEP for n in hits.values()):
            return seed, sorted(hits, key=lambda p: p.document)
    raise AssertionError("no seed puts a poisoned document into step 9")


# the run's plan (python -m train --dry-run --write-budgets) for its own layout; the
# planner's tracer runs no injected faults (they are not in the budgets' fingerprint)
PLAN_ARGS = ("--dry-run", "--world-size", "2", "--gpu", "h100", "--set", "health.inject_faults=[]")


def forensics_args(incident: int, top: int) -> list[str]:
    """The replay on fewer ranks than the run, and at cp 1 (a row is scored on one rank)."""
    return ["--incident", str(incident), "--quarantine-top", str(top), "--parallelism.cp", "1"]


@dataclass
class PoisonedRun:
    run_dir: Path
    data: Path
    seed: int
    in_spike: list[Poisoned]  # the poisoned documents of the spiking step
    forensics: subprocess.CompletedProcess
    resumed_to: int
    seconds: dict
    budgets: bytes  # RUN/budgets.json as the plan wrote it, before the run
    budgets_after: bytes  # ... and after the forensics replay
    check_after: subprocess.CompletedProcess  # the run's --check after the replay
    checkpoints_before: list[int]  # complete checkpoints when the run ended


@pytest.fixture(scope="session")
def poisoned_run(shakespeare_data, tmp_path_factory) -> PoisonedRun:
    from dataloader.prepare import PrepareConfig, prepare

    tmp = tmp_path_factory.mktemp("forensics")
    indices = write_corpus(tmp / "docs.jsonl")
    tokenizer = shakespeare_data / "tokenizer"
    prepare(
        PrepareConfig(
            inputs=[str(tmp / "docs.jsonl")],
            out=tmp / "data",
            tokenizer=str(tokenizer),
            num_workers=1,
            progress=False,
        )
    )
    data = tmp / "data" / "train"
    starts = np.load(data / "documents.npy")
    poisoned = [Poisoned(str(data), i, (int(starts[i]), int(starts[i + 1]))) for i in indices]
    seed, in_spike = choose_seed(data, poisoned)
    run_dir = tmp / "run"
    config = run_config(
        None,
        run_dir,
        {
            "dataloader": {
                "tokenizer": str(tokenizer),
                "mix": [{"path": str(data), "weight": 1.0}],
                "seed": seed,
            },
            "model": TINY_MODEL,
            "optimizer": {"lr": 3e-3},
            "validation": {"enable": False},
            "training": {
                "steps": STEPS,
                "seq_len": SEQ_LEN,
                "local_batch_size": 2,
                "global_batch_size": GLOBAL_BATCH,
            },
            "checkpoint": {
                "interval": CHECKPOINT_INTERVAL,
                "keep_last": 2,  # saves at 9 and 12 would purge 6, the incident's
                "async_mode": "disabled",  # the async daemon costs seconds to start
            },
            "parallelism": {"cp": 2},
            "metrics": {"tensorboard": False},
            "fp8": {"stats_freq": 1},
            "health": {
                "spike_rollback": True,
                "spike_window": 8,
                "spike_warmup": 2,
                "spike_sigmas": 3.0,
                "spike_min_rise": 0.5,
                "inject_faults": [SPIKE],
            },
        },
    )
    seconds = {}
    run_toml = write_config(tmp / "run.toml", config)
    begin = time.perf_counter()
    # planned as a user plans a run: RUN/budgets.json for 2 ranks at cp 2
    check_ok(cli("--config", str(run_toml), *PLAN_ARGS, "--write-budgets", timeout=600))
    budgets = (run_dir / "budgets.json").read_bytes()
    seconds["plan (--write-budgets)"] = time.perf_counter() - begin
    begin = time.perf_counter()
    check_ok(torchrun(run_toml, 2, timeout=600))
    seconds["run (2 ranks, cp 2)"] = time.perf_counter() - begin
    checkpoints_before = complete_steps(run_dir)
    begin = time.perf_counter()
    proc = subprocess.run(
        [PYTHON, "-m", "train.forensics", str(run_dir), *forensics_args(1, len(in_spike))],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    check_ok(proc)
    seconds["forensics (1 process, cp 1)"] = time.perf_counter() - begin
    budgets_after = (run_dir / "budgets.json").read_bytes()
    check_after = cli("--config", str(run_dir / "config.toml"), "--check", "--world-size", "2")
    # resume until the order brings a quarantined document back, past a save
    loader = loader_for(data, seed, skip=[_skip_range(run_dir)])
    for _ in range(STEPS):
        next(loader)
    resumed_to = STEPS
    while (
        not overlapping(loader.last_origins, in_spike) or resumed_to <= STEPS + CHECKPOINT_INTERVAL
    ):
        next(loader)
        resumed_to += 1
    begin = time.perf_counter()
    resume = torchrun(run_dir / "config.toml", 2, "--training.steps", str(resumed_to), timeout=600)
    check_ok(resume)
    seconds["resume (2 ranks)"] = time.perf_counter() - begin
    print(f"poisoned_run: {', '.join(f'{k} {v:.1f} s' for k, v in seconds.items())}")
    return PoisonedRun(
        run_dir, data, seed, in_spike, proc, resumed_to, seconds, budgets, budgets_after,
        check_after, checkpoints_before,
    )  # fmt: skip


def _skip_range(run_dir: Path) -> list[int]:
    (incident,) = [r for r in _incidents(run_dir) if r["kind"] == "loss_spike"]
    return incident["skipped_sequences"]


def _incidents(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "incidents.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- the assertions


def assert_names_poisoned(run_dir: Path, incident: int, poisoned: list[Poisoned]) -> dict:
    """The report of `incident` ranks exactly these documents first; returns the report."""
    report = json.loads(forensics_report(run_dir, incident).read_text())
    ranked = [d for d in report["documents"] if d["ranked"]]
    top = ranked[: len(poisoned)]
    assert {(d["dataset_path"], d["document"], d["first"], d["end"]) for d in top} == {
        (p.dataset, p.document, *p.tokens) for p in poisoned
    }, [(d["document"], round(d["mean_loss"], 3), d["tokens"]) for d in ranked]
    assert len(ranked) > len(poisoned)  # there were clean documents to rank below them
    assert_sources_hold_the_documents(run_dir, ranked)
    return report


def assert_sources_hold_the_documents(run_dir: Path, documents: list[dict]) -> None:
    """Each document's named source file and record (a report's `dataset_path`, `first`,
    `end`; a quarantine record's `dataset`, `tokens`) hold exactly its on-disk text."""
    from tokenizers import Tokenizer

    run = _run_config(run_dir)
    tokenizer = Tokenizer.from_file(str(Path(run.dataloader.tokenizer) / "tokenizer.json"))
    streams = {}
    for doc in documents:
        if doc.get("kind") == "quarantine":
            path, (first, end) = doc["dataset"], doc["tokens"]
        else:
            path, first, end = doc["dataset_path"], doc["first"], doc["end"]
        assert doc["source"] is not None and doc["record"] is not None, doc
        if path not in streams:
            streams[path] = loader_for(path, 0).datasets[0]
        tokens = np.zeros(end - first, dtype=streams[path].dtype)
        streams[path].copy_tokens(first, tokens)
        # one record a line (jsonl); prepare stores BOS + its text's tokens + EOS
        line = Path(doc["source"]).read_text().splitlines()[doc["record"]]
        text = json.loads(line)["text"]
        assert tokenizer.decode(tokens.tolist(), skip_special_tokens=True) == text, doc
        assert len(tokens) == len(tokenizer.encode(text, add_special_tokens=False).ids) + 2


def assert_replay_matches_run(run_dir: Path, incident: int) -> dict:
    """The replayed steps' logged losses are the run's, and the per-token losses add up to
    the spiking step's; returns the report."""
    report = json.loads(forensics_report(run_dir, incident).read_text())
    record = report["incident"]
    assert report["replayed_steps"] == list(range(record["rolled_back_to"] + 1, record["step"] + 1))
    for entry in report["losses"]:
        assert entry["from"] == "metrics.jsonl", entry
        assert entry["replay"] == pytest.approx(entry["run"], rel=REPLAY_RTOL), entry
    spiking = [e for e in report["losses"] if e["step"] in report["spiking_steps"]]
    for entry in spiking:
        assert entry["model_with_faults"] == pytest.approx(entry["replay"], rel=REPLAY_RTOL)
    return report


def assert_quarantined_not_trained(
    run_dir: Path, poisoned: list[Poisoned], resumed_from: int, resumed_to: int
) -> None:
    """The resume from `resumed_from` to `resumed_to` passed over every window of the
    quarantined documents: the real run counted them, and the same loader rebuilt
    in-process yields none of them where the plain order does."""
    records = [r for r in _incidents(run_dir) if r["kind"] == "quarantine"]
    assert {(r["dataset"], r["document"], tuple(r["tokens"])) for r in records} == {
        (p.dataset, p.document, p.tokens) for p in poisoned
    }
    assert_sources_hold_the_documents(run_dir, records)
    lines = read_metrics(run_dir, "train")
    assert [r["step"] for r in lines][-(resumed_to - resumed_from) :] == list(
        range(resumed_from + 1, resumed_to + 1)
    )
    counted = lines[-1]["data_quarantined_windows"]
    assert "data_quarantined_windows" not in lines[-(resumed_to - resumed_from) - 1]

    run = _run_config(run_dir)
    data, seed = run.dataloader.mix[0].path, run.dataloader.seed
    plain, kept = (
        loader_for(data, seed, [_skip_range(run_dir)]),
        loader_for(data, seed, [_skip_range(run_dir)]),
    )
    for _ in range(resumed_from):
        next(plain), next(kept)
    kept.add_quarantine([(r["content_sha256"], *r["tokens"]) for r in records])
    plain_hits, kept_hits = {}, {}
    for _ in range(resumed_from, resumed_to):
        next(plain), next(kept)
        plain_hits |= overlapping(plain.last_origins, poisoned)
        kept_hits |= overlapping(kept.last_origins, poisoned)
    assert plain_hits and not kept_hits, (plain_hits, kept_hits)
    assert kept.quarantined_windows == counted > 0


def _run_config(run_dir: Path):
    from train.config import load_config

    return load_config(run_dir / "config.toml")


# --------------------------------------------------------------------------- the tests


@pytest.mark.slow
def test_forensics_names_the_poisoned_documents_and_replays_the_spike(poisoned_run):
    run = poisoned_run
    report = assert_names_poisoned(run.run_dir, 1, run.in_spike)
    assert report["argv"] == [str(run.run_dir), *forensics_args(1, len(run.in_spike))]
    assert report["world_size"] == 1  # the run had 2 ranks
    assert_replay_matches_run(run.run_dir, 1)
    spike = [e for e in report["losses"] if e["step"] == SPIKE_STEP][0]
    # like with like: the logged losses carry the injected x10, the model's do not
    assert spike["run"] == pytest.approx(10 * spike["model"], rel=REPLAY_RTOL)
    # FP8 statistics of the spiking step itself (fp8.stats_freq = 1), from the spiked
    # lineage (step 9 was trained again after the rollback, with other data)
    fp8 = report["fp8"]
    assert [r["step"] for r in fp8["records"]] == [9, 8, 7], fp8["note"]
    assert "layers.0.feed_forward.w1" in fp8["records"][0]["linears"]
    out = run.forensics.stdout
    first = run.in_spike[0]
    assert f"[{first.tokens[0]}, {first.tokens[1]})" in out
    # each ranked document shown is named by its source file and record on the console too
    shown = [d for d in report["documents"] if d["ranked"]][:10]
    for d in shown:
        assert f"{d['source']}:{d['record']}" in out, out
    assert "not recorded" not in out
    assert "step 9 worst underflow" in out and f"quarantined {len(run.in_spike)} document(s)" in out


@pytest.mark.slow
def test_forensics_leaves_the_run_plan_alone_and_the_run_launchable(poisoned_run):
    """A replay on fewer ranks (1 of 2) and at cp 1 (the run's cp 2) from a run planned with
    --write-budgets: RUN/budgets.json is neither read against the replay, nor written, nor
    named, and the run's next --check on its own layout passes."""
    run = poisoned_run
    assert run.budgets_after == run.budgets
    assert "budgets.json" not in run.forensics.stdout + run.forensics.stderr
    check_ok(run.check_after)
    report = json.loads(forensics_report(run.run_dir, 1).read_text())
    # the replay's own plan: its layout, on this host
    assert report["plan"]["world_size"] == 1 and report["plan"]["fits"]
    assert report["plan"]["degrees"]["cp"] == 1


@pytest.mark.slow
def test_the_checkpoint_of_an_unresolved_incident_outlives_keep_last(poisoned_run):
    """keep_last 2 kept checkpoint 6 through the saves at 9 and 12, since incident 1 rolled
    back to it and had no report yet; once forensics reported, a later save purged it."""
    run = poisoned_run
    assert run.checkpoints_before == [ROLLED_BACK_TO, 9, 12, STEPS], run.checkpoints_before
    after = complete_steps(run.run_dir)
    assert ROLLED_BACK_TO not in after and after[-1] == run.resumed_to, after


@pytest.mark.slow
def test_quarantine_keeps_the_documents_out_of_the_next_epoch(poisoned_run):
    run = poisoned_run
    assert_quarantined_not_trained(run.run_dir, run.in_spike, STEPS, run.resumed_to)
    # the data ledger recomputes the resumed run with the quarantine in force
    report = io.StringIO()
    assert ledger_command.verify(run.run_dir, report) == 0, report.getvalue()


# --------------------------------------------------------------------------- no launch


def _fake_run(tmp_path: Path, incidents: list[dict], checkpoint: bool = False) -> Path:
    """A run folder with a config.toml and incidents.jsonl (no training)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir / "config.toml", run_config(None, run_dir, {"model": TINY_MODEL}))
    (run_dir / "incidents.jsonl").write_text("".join(json.dumps(r) + "\n" for r in incidents))
    if checkpoint:
        (run_dir / "checkpoint" / "step-3").mkdir(parents=True)
        (run_dir / "checkpoint" / "step-3" / ".metadata").write_text("")
    return run_dir


SPIKE_RECORD = {
    "kind": "loss_spike",
    "step": 5,
    "first_spike_step": 5,
    "rolled_back_to": 3,
    "skipped_sequences": [12, 20],
    "losses": [80.0],
    "rollback": 1,
    "time": 100.0,
}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--incident", "2"], "holds 1 loss-spike incident(s); give --incident 1 to 1"),
        (["--incident", "1", "--training.steps", "3"], "a replay may change only the layout"),
        (["--incident", "1", "--quarantine-top", "0"], "--quarantine-top 0: give N >= 1"),
        (["--incident", "1", "--parallelism.cp", "2"], "pass --parallelism.cp 1"),
        (["--incident", "1"], "checkpoint/step-3: incident 1 rolled back to this checkpoint"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    from train.forensics.__main__ import main

    run_dir = _fake_run(tmp_path, [SPIKE_RECORD])
    assert main([str(run_dir), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_run_without_incidents_is_one_line(tmp_path, capsys):
    from train.forensics.__main__ import main

    run_dir = _fake_run(tmp_path, [])
    (run_dir / "incidents.jsonl").unlink()
    assert main([str(run_dir), "--incident", "1"]) == 2
    assert "had no loss-spike rollback" in capsys.readouterr().err


def test_documents_are_ranked_by_the_loss_of_the_tokens_they_hold():
    from train.forensics.report import ScoredRow, rank_documents
    from train.ledger.readers import DocumentRef

    # window [10, 19): tokens 10-14 are document 0's end, 15-18 document 1, 19- document 2
    documents = [
        DocumentRef(0, 2, 15, 8, 13),
        DocumentRef(1, 15, 19, 0, 4),
        DocumentRef(2, 19, 40, 0, 1),
    ]
    losses = np.array([1, 1, 1, 1, 5, 5, 5, 5], dtype=np.float32)  # predicting tokens 11..18
    positions = np.array([0, 1, 2, 3, 4, 0, 1, 2])  # the window start, and document 1 (15)
    row = ScoredRow(9, 0, 33, 0, 0, 10, losses, positions, 10.0)
    meta = [{"path": "DATA/train", "content_sha256": "abc"}]
    ranked = rank_documents([row], meta, lambda d, a, b: documents, min_tokens=4)
    by_doc = {e.document: e for e in ranked}
    # token 15 (the start of document 1) is predicted at index 4: document 1's
    assert by_doc[0].tokens == 4 and by_doc[0].mean_loss == 1.0
    assert by_doc[1].tokens == 4 and by_doc[1].mean_loss == 5.0
    assert by_doc[1].windows == [
        {
            "step": 9,
            "sequence": 33,
            "epoch": 0,
            "window_start": 10,
            "tokens": [15, 19],
            "mean_loss": 5.0,
        }
    ]
    assert [e.document for e in ranked] == [1, 0]  # document 2 holds no predicted token here
    assert [e.document for e in rank_documents([row], meta, lambda *a: documents, 5)] == [1, 0]
    assert not any(e.ranked for e in rank_documents([row], meta, lambda *a: documents, 5))
    bad = ScoredRow(9, 0, 33, 0, 0, 10, losses, np.arange(8), 1.0)  # none at 15
    with pytest.raises(AssertionError, match="positions restart"):
        rank_documents([bad], meta, lambda *a: documents, 4)


def test_quarantine_selection_is_explicit_and_never_repeats():
    from train.forensics.report import DocumentLoss, quarantine_records, select_for_quarantine

    def doc(n, loss, ranked=True):
        return DocumentLoss(
            0, "D", "abc", n, 10 * n, 10 * n + 10, None, None, 10, 10 * loss, loss, [], ranked
        )

    ranked = [doc(1, 9.0), doc(2, 7.0), doc(3, 5.0), doc(4, 9.5, ranked=False)]
    assert [e.document for e in select_for_quarantine(ranked, 2, None)] == [1, 2]
    assert [e.document for e in select_for_quarantine(ranked, None, 6.0)] == [1, 2]
    assert select_for_quarantine(ranked, None, None) == []
    first = quarantine_records(ranked[:2], SPIKE_RECORD, 1, [], now=1.0)
    assert [(r["kind"], r["document"], r["tokens"]) for r in first] == [
        ("quarantine", 1, [10, 20]),
        ("quarantine", 2, [20, 30]),
    ]
    again = quarantine_records(ranked[:3], SPIKE_RECORD, 1, first, now=2.0)
    assert [r["document"] for r in again] == [3]


def test_the_spiking_lineage_is_what_was_logged_before_the_incident(tmp_path):
    """A rollback trains step numbers again: the run's loss and FP8 statistics of the
    spike are the lines written before the incident's record."""
    from train.forensics.report import fp8_statistics, original_losses

    run_dir = tmp_path
    lines, stats = [], []
    for step, time_, loss in [
        (3, 10, 7.0),
        (4, 20, 6.9),
        (5, 30, 70.0),
        (4, 200, 6.8),
        (5, 210, 6.7),
    ]:
        lines.append({"step": step, "time": time_, "loss": loss, "fp8/x/input_amax": 1.0})
        stats.append({"step": step, "linears": {"layers.0.w": {"input": {"underflow": loss}}}})
    lines.insert(3, {"step": 5, "time": 100, "rollback_to": 3.0})  # the marker: no loss
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / "fp8_stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stats))
    losses = original_losses(run_dir, SPIKE_RECORD, [4, 5])
    assert {s: e["loss"] for s, e in losses.items()} == {4: 6.9, 5: 70.0}
    records, note = fp8_statistics(run_dir, SPIKE_RECORD)
    assert [r["linears"]["layers.0.w"]["input"]["underflow"] for r in records] == [70.0, 6.9]
    assert "step(s) [4, 5]" in note
    # a torn or missing statistics line cannot be dated: said, not guessed
    (run_dir / "fp8_stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stats[1:]))
    assert fp8_statistics(run_dir, SPIKE_RECORD)[0] == []
    (run_dir / "fp8_stats.jsonl").unlink()
    assert "no FP8 statistics recorded" in fp8_statistics(run_dir, SPIKE_RECORD)[1]
    # only the spike rule's record of the loss when the step was not logged
    (run_dir / "metrics.jsonl").write_text(json.dumps(lines[0]) + "\n")
    assert original_losses(run_dir, SPIKE_RECORD, [5])[5]["loss"] == 80.0


def test_a_replay_that_cannot_hold_the_model_is_refused_naming_the_world_size_that_fits(
    shakespeare_data, tmp_path, capsys, monkeypatch
):
    """The replay plans its own memory before it loads: a model whose state alone exceeds
    this host's RAM is refused on 1 process in one line, naming 2 ranks (planned to fit)."""
    from train.config import load_config
    from train.forensics.__main__ import main
    from train.forensics.plan import GIB, state_floor, this_device, usable_bytes
    from train.launch_rules import check_launch

    usable = usable_bytes(this_device(1))
    training = {"seq_len": 256, "local_batch_size": 1, "global_batch_size": 8}
    run_dir = tmp_path / "run"

    def config(layers: int) -> dict:
        # layers of ~67M parameters: one layer's buffers are small beside the whole
        model = {"dim": 2048, "n_layers": layers, "n_heads": 16, "n_kv_heads": 8}
        model["ffn_hidden_dim"] = 8192
        return run_config(shakespeare_data, run_dir, model=model, training=training)

    # the fewest layers whose model state (16 bytes a parameter) outgrows a rank's memory:
    # just over it on 1 rank (refused without a trace), about half of it on 2 (planned)
    layers = 2
    while True:
        path = write_config(tmp_path / "probe.toml", config(layers))
        run = load_config(path)
        if state_floor(run, check_launch(run, 1)) > usable:
            break
        layers += 1
    run_dir.mkdir()
    write_config(run_dir / "config.toml", config(layers))
    (run_dir / "incidents.jsonl").write_text(json.dumps(SPIKE_RECORD) + "\n")
    (run_dir / "checkpoint" / "step-3").mkdir(parents=True)
    (run_dir / "checkpoint" / "step-3" / ".metadata").write_text("")

    # the world of one a plain `python -m train.forensics` sets itself, undone after the
    # test (later tests' subprocesses inherit this environment)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "1" if "WORLD" in key else "0")
    assert main([str(run_dir), "--incident", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the replay does not fit on 1 rank(s)"), err
    assert f"a rank has {usable / GIB:.1f} GiB usable" in err[0]
    assert "launch at least 2 ranks with this layout" in err[0], err
    # refused before anything was loaded or written: not even the replay's folder
    assert not (run_dir / "forensics").exists()
