"""Loss-spike rollback with an exact data skip (train/reliability/health.py), on real gloo runs.

Three launches prove it all (tiny model, global batch 4 = global sequences 4(s-1)..4s-1 at
step s, a checkpoint every 2 steps; the injected spikes are keyed to global sequences):
- `spiked` (2 ranks): sequences 16-19 (step 5) spike, the run rolls back to step 4 and
  skips [16, 20); after the rollback, sequences 28-31 (then step 7) spike again, and with
  health.max_rollbacks = 1 it stops with one line and exit 4.
- `reference` (2 ranks): dataloader.skip_sequences = [[16, 20]] from the start (it never
  sees them, and the spike keyed to them never fires); its trace must equal the spiked
  run's after the rollback.
- `resharded` (1 rank): the spiked run's state right after its rollback and before its
  next checkpoint (checkpoint step-4 and RUN/incidents.jsonl; what a preemption there
  leaves), resumed on 1 rank: it must skip [16, 20) again, read from incidents.jsonl.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.train.test_regression_assets import TRACE_TOLERANCE
from tests.train.test_train_distributed import RESUME_RTOL
from tests.utils.runs import check_ok, read_metrics, run_config, torchrun, write_config
from tests.utils.tiny_model import TINY_TRAIN_MODEL

FIRST_SPIKE = "spike sequences=16-19 factor=10"  # step 5's data
SECOND_SPIKE = "spike sequences=28-31 factor=10"  # step 7's data after the rollback


def _config(data, folder, faults, checkpoint=None, **dataloader):
    """`checkpoint`: the reference's and the resharded run's own (their saves are not under
    test: no async checkpoint daemon to start, or no saves at all)."""
    return run_config(
        data,
        folder,
        {
            "model": TINY_TRAIN_MODEL,
            "validation": {"enable": False},
            "training": {"steps": 8, "seq_len": 64, "local_batch_size": 2, "global_batch_size": 4},
            "checkpoint": checkpoint or {"interval": 2, "keep_last": 0},
            "dataloader": dataloader,
            "health": {
                "spike_rollback": True,
                "spike_window": 8,
                "spike_warmup": 2,
                "spike_sigmas": 3.0,
                "spike_min_rise": 0.5,
                "max_rollbacks": 1,
                "inject_faults": faults,
            },
        },
    )


def _losses(run_dir) -> dict[int, float]:
    """Per step, the loss that counts: a rolled-back or resumed step's later line."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


@pytest.fixture(scope="module")
def runs(shakespeare_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollback")
    spiked, reference, resharded = tmp / "spiked", tmp / "reference", tmp / "resharded"
    config = write_config(
        tmp / "spiked.toml",
        _config(shakespeare_data, spiked, [FIRST_SPIKE, SECOND_SPIKE]),
    )
    spiked_proc = torchrun(config, 2, timeout=600)
    config = write_config(
        tmp / "reference.toml",
        _config(
            shakespeare_data,
            reference,
            [FIRST_SPIKE],
            checkpoint={"enable": False},
            skip_sequences=[[16, 20]],
        ),
    )
    check_ok(torchrun(config, 2, timeout=600))
    # what a preemption after the rollback, before the step-6 checkpoint, leaves behind
    (resharded / "checkpoint").mkdir(parents=True)
    shutil.copytree(spiked / "checkpoint" / "step-4", resharded / "checkpoint" / "step-4")
    shutil.copy(spiked / "incidents.jsonl", resharded / "incidents.jsonl")
    saves = {"interval": 2, "keep_last": 0, "async_mode": "disabled"}
    config = write_config(
        tmp / "resharded.toml", _config(shakespeare_data, resharded, [FIRST_SPIKE], saves)
    )
    resharded_proc = torchrun(config, 1, timeout=600)
    check_ok(resharded_proc)
    return spiked_proc, spiked, reference, resharded_proc, resharded


@pytest.mark.slow
def test_spike_rolls_back_skips_its_data_and_matches_a_run_that_never_saw_it(runs):
    proc, spiked, reference, _, _ = runs
    out = proc.stdout + proc.stderr
    incidents = [json.loads(line) for line in (spiked / "incidents.jsonl").read_text().splitlines()]
    assert len(incidents) == 1, out[-3000:]
    incident = incidents[0]
    assert incident["kind"] == "loss_spike" and incident["step"] == 5
    assert incident["first_spike_step"] == 5 and incident["rolled_back_to"] == 4
    assert incident["skipped_sequences"] == [16, 20]
    assert incident["losses"][0] > 5 * incident["mean"]  # the injected x10
    assert "rolled back to checkpoint step 4" in out and "[16, 20) are skipped" in out

    # the marker, in metrics.jsonl and TensorBoard, at the spike's step
    markers = [r for r in read_metrics(spiked) if "rollback_to" in r]
    assert [(r["step"], r["rollback_to"], r["rollback_skipped_sequences"]) for r in markers] == [
        (5, 4, 4)
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(spiked / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("health/rollback_to_step")] == [(5, 4.0)]

    # steps 1-4, and 5-6 after the rollback, are the reference's (which never drew 16-19)
    lines = [r for r in read_metrics(spiked, "train")]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 5, 6, 7]  # 5 spiked, rolled back
    losses, expected = _losses(spiked), _losses(reference)
    assert sorted(expected) == list(range(1, 9))
    for step in range(1, 7):
        assert losses[step] == pytest.approx(expected[step], abs=TRACE_TOLERANCE), step
    # ... and the spiked step 5 was not (the tolerance is far below a spike)
    assert lines[4]["loss"] > expected[5] + 1
    reference_lines = read_metrics(reference, "train")
    assert [r["data_skipped_sequences"] for r in reference_lines] == [0] * 4 + [4] * 4
    assert [r["data_skipped_sequences"] for r in lines][5:] == [4, 4, 4]
    assert [r["tokens_seen"] for r in lines][5:] == [r["tokens_seen"] for r in reference_lines][4:7]


@pytest.mark.slow
def test_second_spike_past_max_rollbacks_stops_with_one_line(runs):
    proc, spiked, *_ = runs
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and re.search(r"exitcode\s*:\s*4", out), out[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    assert errors[0].startswith("error: step 7: loss spike (")
    assert "1 rollback(s) already (health.max_rollbacks = 1): stopping" in errors[0]
    assert errors[0].endswith(f"Last good checkpoint: {spiked / 'checkpoint' / 'step-6'}")
    diverged = json.loads((spiked / "diverged.json").read_text())
    assert diverged["step"] == 7 and "loss spike" in diverged["reason"]
    assert not (spiked / "checkpoint" / "step-7").exists()  # a spike's step is not saved


@pytest.mark.slow
def test_resume_on_one_rank_after_the_rollback_skips_the_same_data(runs):
    _, _, reference, proc, resharded = runs
    out = proc.stdout + proc.stderr
    assert "gradient accumulation steps 2" in out
    assert "global sequences [[16, 20]] are skipped" in out
    # the spike keyed to 16-19 never fired: nothing new in incidents.jsonl
    assert len((resharded / "incidents.jsonl").read_text().splitlines()) == 1
    losses, expected = _losses(resharded), _losses(reference)
    assert sorted(losses) == [5, 6, 7, 8]
    for step in losses:  # 2 ranks vs 1 rank x 2 micro-batches: RESUME_RTOL
        assert losses[step] == pytest.approx(expected[step], rel=RESUME_RTOL), step
    assert [r["data_skipped_sequences"] for r in read_metrics(resharded, "train")] == [4] * 4
