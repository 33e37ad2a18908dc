"""The ledger of a run trained by torchft replica groups: every group's ledger
(RUN/replicas/G/ledger.jsonl, `train.replica_groups.recorder`) merged into one lineage and
verified as one run.

Why a merge: groups die and come back on their own, so each group's ledger has the steps it
took part in and nothing else; a step is vouched for by any group that committed it, since
every such record carries the digest of all the step's rows (summed over the live groups in
the reduction that carried the gradients). What is checked, torch-free, on top of what
`train.ledger.replay` checks for one run:

* each group's chain, as for a single ledger;
* agreement: every group that committed step s recorded the same rows, tokens, digest,
  position after it, size (`sequences`) and quorum (which groups, how many), and each of
  them is one of that quorum's groups;
* a step that did not commit (an `attempt` record) was served from the position after the
  step before, so its data is served again, not lost;
* a heal: the group continued from step c with the loader position the run had after step
  c, and the same order parameters; a resume (a relaunch from the checkpoint of step c)
  likewise, and the group's records of the steps after c that it went back past are
  superseded by those it trains again;
* then the merged lineage, one record per step, is replayed like any ledger
  (`Replay` over the merge): every step recomputed from the loader's own order at its own
  size (its live groups' slices), so no window is trained twice and none lost beyond the
  declared skips, across every change of quorum.
"""

from __future__ import annotations

from pathlib import Path

from common.run_layout import LEDGER, replica_dir, replica_groups
from dataloader.ledger_record import GENESIS, chain_hash, read_lines
from train.ledger.checks import Finding, Note
from train.ledger.replay import Replay

AGREE = ("rows", "tokens", "digest", "cursor", "skipped", "sequences", "applied")


def _read_group(run_dir: Path, group: int, note: Note) -> list[dict]:
    """Group `group`'s records in file order, its chain checked."""
    path = replica_dir(run_dir, group) / LEDGER
    records, previous = [], GENESIS
    if not path.is_file():
        return records
    for line, record in read_lines(path):
        if record is None:
            note("note", f"group {group} line {line} is torn (a kill mid-append)")
            continue
        if record.get("chain") != chain_hash(previous, record):
            note("MISMATCH", f"group {group} line {line}: chain hash broken", record.get("step"))
        previous = record.get("chain", previous)
        records.append(record | {"_group": group, "_line": line})
    return records


def _final(records: list[dict]) -> list[dict]:
    """A group's records less the steps (and attempts) a later resume or rollback of the
    group went back past: a relaunch from a checkpoint trains them again."""
    kept: list[dict] = []
    for r in records:
        if r.get("kind") == "segment" and r.get("cause") in ("resume", "rollback"):
            c = int(r["continues_from"])
            kept = [x for x in kept if x.get("kind") not in ("step", "attempt") or x["step"] <= c]
        kept.append(r)
    return kept


def run_replay(run_dir: str | Path, **replay_kwargs) -> tuple[Replay, list[Finding]]:
    """Any run's ledger replayed (`Replay`'s keywords), as `verify`, `which` and `coverage`
    read it: a run of replica groups merged first (`replica_replay`), else RUN/ledger.jsonl;
    and the merge's findings ([] for a single ledger)."""
    if replica_groups(run_dir):
        return replica_replay(run_dir, **replay_kwargs)
    return Replay(run_dir, **replay_kwargs).run(), []


def replica_replay(run_dir: str | Path, **replay_kwargs) -> tuple[Replay, list[Finding]]:
    """The merged lineage replayed, and the findings of the merge (in that order of
    importance: a merge finding is about the groups' agreement)."""
    run_dir = Path(run_dir)
    findings: list[Finding] = []

    def note(level: str, text: str, step: int | None = None) -> None:
        findings.append(Finding(level, text, step))

    by_group = {g: _final(_read_group(run_dir, g, note)) for g in replica_groups(run_dir)}
    every = [r for records in by_group.values() for r in records]
    segments = [r for r in every if r.get("kind") == "segment"]
    heals = [r for r in segments if r.get("cause") in ("heal", "resume")]
    attempts = [r for r in every if r.get("kind") == "attempt"]
    steps: dict[int, list[dict]] = {}
    for r in every:
        if r.get("kind") == "step":
            steps.setdefault(int(r["step"]), []).append(r)
    merged: dict[int, dict] = {}
    for step, records in sorted(steps.items()):
        first = records[0]
        quorum = first.get("quorum", {})

        def members(r: dict) -> tuple:
            q = r.get("quorum", {})
            return q.get("live"), q.get("groups")  # each group's own rank differs

        for r in records[1:]:
            differ = [k for k in AGREE if r.get(k) != first.get(k)]
            if members(r) != members(first):
                differ.append("quorum")
            if differ:
                note(
                    "MISMATCH",
                    f"groups {first['_group']} and {r['_group']} recorded step {step} "
                    f"differently ({', '.join(differ)})",
                    step,
                )
        for r in records:
            if r["_group"] not in quorum.get("groups", []):
                note(
                    "MISMATCH",
                    f"group {r['_group']} committed step {step} outside its "
                    f"quorum {quorum.get('groups')}",
                    step,
                )
        if len(quorum.get("groups", [])) != quorum.get("live"):
            note(
                "MISMATCH",
                f"step {step}: quorum of {quorum.get('live')} group(s) but "
                f"{quorum.get('groups')} took part",
                step,
            )
        merged[step] = first
    starts = sorted((s for s in segments if s.get("cause") == "start"), key=lambda s: s["time"])
    if not starts:
        raise ValueError(f"{run_dir}: no replica group recorded the run's start")
    origin = starts[0]

    def after(step: int):
        return origin["cursor"] if step == 0 else merged.get(step, {}).get("cursor")

    for heal in heals:
        c = int(heal["continues_from"])
        how = "healed" if heal["cause"] == "heal" else "resumed"
        if heal["cursor"] != after(c) or heal["params"] != origin["params"]:
            note(
                "MISMATCH",
                f"group {heal['_group']} {how} to step {c} with another loader "
                "position or order than the run's",
                c + 1,
            )
        else:
            source = "from a peer" if how == "healed" else "from its checkpoint"
            note("ok", f"group {heal['_group']} {how} {source} at step {c}", c + 1)
    for a in attempts:
        step = int(a["step"])
        if a["cursor"] != after(step - 1):
            note(
                "MISMATCH",
                f"group {a['_group']}'s uncommitted step {step} was not served "
                "from the position after the step before",
                step,
            )
    if attempts:
        note(
            "ok",
            f"{len(attempts)} uncommitted attempt(s) of step(s) "
            f"{sorted({int(a['step']) for a in attempts})} served again",
        )
    changes = sum(
        s - 1 in merged
        and merged[s]["quorum"].get("groups") != merged[s - 1]["quorum"].get("groups")
        for s in merged
    )
    note("ok", f"{len(by_group)} replica group(s), {changes} quorum change(s)")
    lineage, previous = [], GENESIS
    for record in [origin] + [merged[s] for s in sorted(merged)]:
        body = {k: v for k, v in record.items() if not k.startswith("_") and k != "chain"}
        body["chain"] = previous = chain_hash(previous, body)
        lineage.append(body)
    return Replay(run_dir, records=lineage, **replay_kwargs).run(), findings
