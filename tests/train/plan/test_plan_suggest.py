"""`python -m train --dry-run --suggest`: the layouts the launch rules admit, ranked, each
judged on counts scaled from one traced step per AC mode (`train.plan.suggest`).

The scaling is an approximation; this holds it to the plan it stands in for: the printed
estimate of several layouts against a full `plan` of each (docs/dry_run.md, "Suggest")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from train.__main__ import main
from train.config import load_config
from train.plan.dry_run import GIB, plan
from train.plan.suggest import Candidate, apply, candidates

REPO = Path(__file__).resolve().parents[3]
CONFIG_8B = REPO / "configs" / "llama3_8b_fp8.toml"
ROW = re.compile(
    r"^\s+(\d*)\s+(\d+)\s+(\d+)\s+(\d+) (\w+)\s+(\d+)\s+(\d+)\s+(~?)\s*([\d,]+)\s+\d+%\s+"
    r"[\d.]+\s+([\d.]+)\s.*(FITS|TIGHT|DOES NOT FIT)\s*$"
)
# Agreement of the suggestion with the full plan, shrunk model (docs/dry_run.md, "Suggest")
TOKENS_TOLERANCE = 0.10
MEMORY_TOLERANCE = 0.20


def _rows(out: str) -> dict[Candidate, tuple[float, float, str]]:
    """Printed layout -> (tokens/s/GPU, reserved GiB, verdict)."""
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            _, dp, tp, cp, ac, local, _, _, tokens, reserved, verdict = m.groups()
            candidate = Candidate(int(dp), int(tp), int(cp), ac, int(local))
            rows[candidate] = (float(tokens.replace(",", "")), float(reserved), verdict)
    return rows


def test_suggest_ranks_admitted_layouts_and_agrees_with_the_full_plan(capsys):
    """The README's command, on the 8B config shrunk to 3 layers (traced whole: the cost of
    a trace is its ops, not their sizes, and the scaling is checked at the real widths),
    with an MI300X beside the H100: the same candidates judged on both from one set of
    traces (`--gpu h100,mi300x`), the H100's ranking printed in full, then the comparison."""
    overrides = ["--model.n_layers", "3"]
    argv = ["--config", str(CONFIG_8B), "--dry-run", "--suggest", "--world-size", "8"]
    assert main([*argv, "--gpu", "h100,mi300x", *overrides]) == 0
    out, compare = capsys.readouterr().out.split("\ncompare: ")
    run = load_config(CONFIG_8B, overrides)
    admitted, refused = candidates(run, 8, 8)
    # every layout that passes the launch rules is counted (none refused at 8B's shapes)
    assert f"{len(admitted)} layouts pass the launch rules ({refused} refused)" in out
    assert {(c.tp, c.cp) for c in admitted} >= {(1, 1), (2, 2), (8, 1), (1, 8)}
    rows = list(_rows(out).items())
    assert len(rows) == 9  # the top 8 that fit, then the config's own layout
    # FITS before TIGHT, each by predicted tokens/s
    ranked = [(verdict != "FITS", -tokens) for _, (tokens, _, verdict) in rows[:-1]]
    assert ranked == sorted(ranked)
    own = Candidate(8, 1, 1, run.activation_checkpoint.mode, run.training.local_batch_size)
    assert rows[-1][0] == own and "plan the pick in full" in out
    # the estimate against the full plan, away from the traced layout (tp 2, cp 2, local 2)
    first = rows[0][0]
    with_cp = next(c for c, _ in rows if c.cp == 2 and c.ac != first.ac)
    for candidate in (first, with_cp, own):
        tokens, reserved, _ = dict(rows)[candidate]
        full = plan(apply(run, candidate), 8, "h100", phases=False)
        assert tokens == pytest.approx(full.prediction.tokens_per_s_per_gpu, rel=TOKENS_TOLERANCE)
        assert reserved == pytest.approx(full.peak / GIB, rel=MEMORY_TOLERANCE, abs=0.01)
    # layouts within the held-out error of the first are flagged
    assert any("~" in line for line in out.splitlines() if ROW.match(line))
    # vendors: each kind's best and the config's own; the own layout holds the same memory
    # on both cards, so the MI300X leaves 112 GB more headroom, less the 5 % outside torch
    assert re.search(r"^\s+h100\s+best: FSDP", compare, re.M)
    assert re.search(r"^\s+mi300x\s+best: FSDP", compare, re.M)
    owns = re.findall(r"own: .*?\s+[\d,]+\s+[\d,]+-[\d,]+\s+([\d.]+)\s+(-?[\d.]+) ", compare)
    (h100_gib, h100_room), (mi300x_gib, mi300x_room) = owns
    assert h100_gib == mi300x_gib
    assert float(mi300x_room) - float(h100_room) == pytest.approx(112 * 0.95, abs=0.15)


def test_suggest_refuses_an_unknown_gpu_kind_before_tracing(capsys):
    argv = ["--config", str(CONFIG_8B), "--dry-run", "--suggest", "--world-size", "8"]
    assert main([*argv, "--gpu", "h100,v100"]) == 2
    assert "--gpu 'v100' is not known" in capsys.readouterr().err
