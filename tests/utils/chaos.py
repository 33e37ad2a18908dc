"""The chaos run: one real gloo training run through everything that can break exact-once
data, shared by the tests that read what it leaves (the data ledger's, and spike
forensics').

`build_chaos_run(tmp)` prepares a small synthetic corpus and trains it in three launches
(session fixture `chaos_run` in tests/train/conftest.py):

- the corpus: two jsonl files of English-like documents (words of README.md), tokenized
  with a byte-level tokenizer that has no merges (one token per character), so a document
  rewritten with other characters of the same length keeps every token offset. That is how
  the poisoned documents land exactly where the spike is: the corpus is prepared once
  clean, the loader's own order says which windows the spiked global sequences are, the
  documents under three of those windows are rewritten (`POISON`: random characters, or a
  run of one character) and the corpus is prepared again, with the same document index.
- launch 1, 2 ranks: steps 1-4 (a checkpoint at 3), then rank 0 sleeps inside step 5
  (`health.inject_faults`) and the test kills every process with SIGKILL: the ledger holds
  step 4, trained after the last checkpoint. The fixture then leaves what a kill in the
  middle of a save would: a step-4 folder with a partial shard and no `.metadata`;
- launch 2, 3 ranks: skips the torn step-4 folder and resumes from checkpoint 3, the newest
  complete one, at step 4 (step 4 again), a seq_len phase raises seq_len 32
  -> 64 at step 6, the injected spike on global sequences 42-47 (step 8, the poisoned
  windows) rolls the run back to checkpoint 6 and skips [36, 48); steps 7-9 again;
- launch 3, 1 rank: resumes at step 10 with a new seq_len phase starting there (48 tokens,
  a seq_len change at a resume), steps 10-12.

Global batch 6, local batch 1: data-parallel 2, 3 and 1 all divide it (check_launch's
rule), with 3, 2 and 6 accumulation micro-steps. ~60 s on 2 cores (most of it start-up).
"""

from __future__ import annotations

import json
import os
import random
import signal
import string
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import run_layout
from tests.utils.runs import (
    REPO,
    check_ok,
    children_of,
    read_metrics,
    run_config,
    torchrun,
    torchrun_cmd,
    train_env,
    write_config,
)

TINY_MODEL = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 2,
    "n_kv_heads": 1,
    "ffn_hidden_dim": 128,
    "vocab_size": 512,  # >= the byte tokenizer's 260
    "max_seq_len": 128,
}
GLOBAL_BATCH = 6
SEQ_LEN, PHASE_STEP, PHASE_SEQ_LEN = 32, 6, 64  # the run's seq_len phase
RESUME_STEP, RESUME_SEQ_LEN = 10, 48  # launch 3's phase, starting at its resume
SPIKE_STEP = 8  # the spiked step before the rollback: global sequences 42-47
SPIKED = ((SPIKE_STEP - 1) * GLOBAL_BATCH, SPIKE_STEP * GLOBAL_BATCH - 1)
KILLED_IN_STEP = 5
TORN_STEP = 4  # a torn save left after the kill: newer than checkpoint 3, no .metadata
SEED = 1234
BLOCKS = {"block_tokens": 512, "shuffle_blocks": 4}  # small groups: seq_len changes cut them
POISON = ("random", "repeat", "random")  # the rewrite of each poisoned document


@dataclass
class PoisonedDocument:
    source: str  # the jsonl file, as prepare was given it
    record: int  # its 0-based line
    document: int  # its index in DATA/train
    kind: str  # "random" characters or a "repeat"ed one
    sequence: int  # the spiked global sequence whose window it lies under


@dataclass
class ChaosRun:
    run_dir: Path
    data: Path  # DATA: tokenizer/ and train/
    config: Path  # the last launch's config
    spiked_sequences: tuple[int, int]  # the spike fault's global sequences, inclusive
    incident: dict  # RUN/incidents.jsonl's record of the rollback
    incident_index: int  # its 1-based position in RUN/incidents.jsonl
    poisoned: list[PoisonedDocument]
    seconds: float  # wall time of the three launches
    outputs: list[str] = field(default_factory=list)  # each launch's stdout + stderr


def _documents(rng: random.Random, count: int) -> list[str]:
    words = [w for w in (REPO / "README.md").read_text().split() if w.isascii() and w.isalpha()]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(10, 40)))[: rng.randint(60, 240)]
        for _ in range(count)
    ]


def _write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _byte_tokenizer(out: Path) -> Path:
    """A byte-level tokenizer whose only merges join control bytes that no document holds:
    one token per character of printable text, whatever the text."""
    from dataloader.tokenizer import install_tokenizer, train_bpe

    install_tokenizer(None, train_bpe(["\x00\x01" * 64], 260), out)
    return out


def _prepare(files: list[Path], out: Path, tokenizer: Path) -> None:
    from dataloader.prepare import PrepareConfig, prepare

    prepare(
        PrepareConfig(
            inputs=[str(f) for f in files],
            out=out,
            tokenizer=str(tokenizer),
            shard_chars=8000,
            num_workers=1,
            progress=False,
        )
    )


def _spiked_windows(train: Path, seed: int) -> list[tuple[int, int]]:
    """(on-disk start, sequence) of the windows of the spiked global sequences, as the
    loader deals them before any rollback (one rank taking whole steps: the same rows)."""
    from dataloader import MixEntry, TokenShardDataLoader
    from dataloader.loader import SchedulePhase

    config = TokenShardDataLoader.Config(
        mix=[MixEntry(str(train))],
        seed=seed,
        start_seq_len=SEQ_LEN,
        schedule=[SchedulePhase((PHASE_STEP - 1) * GLOBAL_BATCH, None, PHASE_SEQ_LEN)],
        prefetch=0,
        **BLOCKS,
    )
    loader = config.build(
        dp_world_size=1, dp_rank=0, seq_len=PHASE_SEQ_LEN, local_batch_size=GLOBAL_BATCH
    )
    for _ in range(SPIKE_STEP):
        next(loader)
    assert loader.last_sequences == list(range(SPIKED[0], SPIKED[1] + 1))
    return [
        (start, n)
        for (_, _, start), n in zip(loader.last_origins, loader.last_sequences, strict=True)
    ]


def _poisoned_corpus(tmp: Path) -> tuple[Path, list[Path], list[PoisonedDocument]]:
    """DATA with three documents under the spiked windows rewritten (same lengths)."""
    from dataloader.manifest import Manifest
    from dataloader.provenance import Provenance

    rng = random.Random(28)
    texts = [_documents(rng, 140), _documents(rng, 140)]
    raw = tmp / "raw"
    raw.mkdir()
    files = [raw / f"part{i}.jsonl" for i in range(2)]
    for path, part in zip(files, texts, strict=True):
        _write_jsonl(path, part)
    clean, tokenizer = tmp / "clean", _byte_tokenizer(tmp / "tokenizer")
    _prepare(files, clean, tokenizer)
    manifest = Manifest.load(clean / "train")
    starts = np.load(manifest.documents_path)
    provenance = Provenance.of(manifest)
    poisoned: list[PoisonedDocument] = []
    windows = _spiked_windows(clean / "train", SEED)[: len(POISON)]
    for (start, sequence), kind in zip(windows, POISON, strict=True):
        middle = start + PHASE_SEQ_LEN // 2
        document = int(np.searchsorted(starts, middle, side="right")) - 1
        source, record = provenance.locate(document)
        poisoned.append(PoisonedDocument(source, record, document, kind, sequence))
    assert len({p.document for p in poisoned}) == len(poisoned), "one window, one document"
    for p in poisoned:
        part = texts[files.index(Path(p.source))]
        length = len(part[p.record])
        part[p.record] = (
            "".join(
                rng.choice(string.ascii_letters + string.digits + string.punctuation)
                for _ in range(length)
            )
            if p.kind == "random"
            else "z" * length
        )
    for path, part in zip(files, texts, strict=True):
        _write_jsonl(path, part)
    data = tmp / "data"
    _prepare(files, data, tokenizer)
    # the same document index: every window is where the clean corpus had it
    assert (data / "train" / "documents.npy").read_bytes() == manifest.documents_path.read_bytes()
    return data, files, poisoned


def _config(data: Path, run_dir: Path, faults: list[str], schedule: list[dict]) -> dict:
    config = run_config(
        data,
        run_dir,
        {
            "model": TINY_MODEL,
            "validation": {"enable": False},
            "training": {
                "steps": 12,
                "seq_len": SEQ_LEN,
                "local_batch_size": 1,
                "global_batch_size": GLOBAL_BATCH,
            },
            "checkpoint": {"interval": 3, "keep_last": 0, "async_mode": "disabled"},
            "dataloader": {"seed": SEED, "schedule": schedule, **BLOCKS},
            "metrics": {"log_freq": 1},
            "health": {
                "spike_rollback": True,
                "spike_window": 8,
                "spike_warmup": 2,
                "spike_sigmas": 3.0,
                "spike_min_rise": 1.0,
                "max_rollbacks": 2,
                "inject_faults": faults,
            },
        },
    )
    config["validation"].pop("mix")  # DATA has no val split; validation is off
    return config


def _newest_record(run_dir: Path) -> int:
    path = run_dir / run_layout.LEDGER
    if not path.is_file():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line).get("step", 0))
        except json.JSONDecodeError:
            pass  # being written
    return max(steps)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's workers (their own process group) and torchrun."""
    for worker in children_of(proc.pid):
        os.kill(worker, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def build_chaos_run(tmp: Path) -> ChaosRun:
    started = time.monotonic()
    data, _, poisoned = _poisoned_corpus(tmp)
    run_dir = tmp / "run"
    phase = [{"start_step": PHASE_STEP, "seq_len": PHASE_SEQ_LEN}]
    outputs = []

    # launch 1: 2 ranks; rank 0 sleeps in step 5's backward, after step 4 is recorded
    sleep = f"sleep rank=0 seconds=600 steps={KILLED_IN_STEP}"
    first = write_config(tmp / "launch1.toml", _config(data, run_dir, [sleep], phase))
    log = (tmp / "launch1.log").open("w")
    proc = subprocess.Popen(
        torchrun_cmd(first, 2),
        cwd=REPO,
        env=train_env(),
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while _newest_record(run_dir) < KILLED_IN_STEP - 1:  # a whole line for step 4
            assert proc.poll() is None, (tmp / "launch1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "launch 1 never reached step 4"
            time.sleep(0.2)
    finally:
        _kill_tree(proc)
        log.close()
    outputs.append((tmp / "launch1.log").read_text())
    # what a kill in the middle of a save leaves: a newer step folder without .metadata
    torn = run_dir / "checkpoint" / f"step-{TORN_STEP}"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")

    # launch 2: 3 ranks; the spike on step 8's data rolls back to checkpoint 6
    spike = f"spike sequences={SPIKED[0]}-{SPIKED[1]} factor=10"
    second = write_config(tmp / "launch2.toml", _config(data, run_dir, [spike], phase))
    proc2 = torchrun(second, 3, "--training.steps", "9", timeout=600)
    check_ok(proc2)
    outputs.append(proc2.stdout + proc2.stderr)

    # launch 3: 1 rank; a seq_len phase starts at the resume
    phases = phase + [{"start_step": RESUME_STEP, "seq_len": RESUME_SEQ_LEN}]
    third = write_config(tmp / "launch3.toml", _config(data, run_dir, [spike], phases))
    proc3 = torchrun(third, 1, timeout=600)
    check_ok(proc3)
    outputs.append(proc3.stdout + proc3.stderr)

    incidents = [
        json.loads(line) for line in (run_dir / run_layout.INCIDENTS).read_text().splitlines()
    ]
    assert len(incidents) == 1, outputs[1][-3000:]
    assert max(r["step"] for r in read_metrics(run_dir) if "loss" in r) == 12
    return ChaosRun(
        run_dir=run_dir,
        data=data,
        config=third,
        spiked_sequences=SPIKED,
        incident=incidents[0],
        incident_index=1,
        poisoned=poisoned,
        seconds=time.monotonic() - started,
        outputs=outputs,
    )
