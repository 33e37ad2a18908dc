"""The data ledger: which windows every optimizer step trained, recorded by the run and
recomputed by anyone from the config, the manifests and the incidents alone.

Why: the loader's promise (every window of the corpus exactly once, across crashes,
rollbacks, reshards and seq_len changes) is the heart of this project, and audits ask for
it in writing: for licensing, an opt-out or a contamination check, *which documents did
this checkpoint train on, and did it see each one exactly once?* The order is a pure
function of (seed, manifests, mix and seq_len schedules, skip ranges), so the answer can
be recomputed; what the ledger adds is evidence of what the ranks *actually* did, so that
a recomputation that agrees with it is a proof, and one that does not names the step.

What the run records (`RUN/ledger.jsonl`, `common.run_layout.LEDGER`; rank 0's writer
thread appends one JSON line per optimizer step through `LedgerWriter`, and fsyncs every
few steps and before each checkpoint save, off the training thread:
`train.ledger.recorder.LedgerWriterThread`):

* A *step record* per optimizer step, written after the update was applied or skipped
  (train/ledger/recorder.py, a step hook called once a step, its `after_step`): whether the update was
  applied, the step's row digest, the loader's position after the step (`Cursor`, a few
  ints per dataset) and its counters of what was skipped: sequences in skip ranges
  (rollbacks, `dataloader.skip_sequences`), and input tokens dropped at block tails and
  seq_len group cuts. Its size is fixed by the number of datasets in the mix, never by the
  corpus or the step count: O(steps) bytes in all, ~0.4 KB a step for one dataset.
* The *row digest* is what makes it a record of what the ranks trained rather than of what
  rank 0 believes: each rank hashes each row its loader returned during the step,
  (global sequence, dataset, epoch, on-disk start, seq_len), into three 31-bit lanes, and
  sums them with a row count and a token count into five int64 lanes (`StepTap`, fed by the
  loader itself as it returns batches). Sums are order-free and fixed-size, so one extra
  all_reduce of 40 bytes per step combines all ranks (no O(W) gather; on NCCL a few tens
  of microseconds, latency-bound), and the digest does not depend on how the step's rows
  were dealt, which is why a resize 2 -> 3 -> 1 keeps one chain: the global order does not
  depend on the number of ranks, and neither does the record. A rank that read the wrong
  rows (a missing, repeated or misplaced window) changes the sums; a wrong row escapes only
  if its three random 31-bit lanes happen to cancel (~2^-93). With tensor, context or
  pipeline parallelism several ranks hold the same rows; the recorder divides by the
  number of copies, and copies that disagree cannot divide evenly (flagged).
* A *segment record* before the first step of each process start and of each loss-spike
  rollback: why the segment began (`start`, `resume` from checkpoint step c, `rollback` to
  checkpoint step c), the loader parameters it ran with (`OrderParameters`: mix paths,
  weights and manifest content hashes, seed, seq_len, schedule, block sizes, skip ranges,
  sequences per step), how many loss-spike rollbacks and quarantined documents of
  RUN/incidents.jsonl were in force (with the token ranges the quarantines made), a sha256 of
  RUN/config.toml, the layout (ranks, data-parallel degree, local batch, accumulation) and
  the loader's position when the segment began.
* Each record carries `chain` = sha256(previous record's chain + the record's canonical
  JSON): a record edited or removed without rewriting every later one breaks the chain at
  that record. The chain is not a signature (anyone can rewrite a file end to end); what
  makes a ledger trustworthy is that `verify` recomputes every field of every record
  independently, so a rewritten ledger must also be a correct one.

Lineage. Steps recorded after the last checkpoint before a kill -9 are trained again after
the resume, and a rollback goes back to an earlier checkpoint: the file is chronological,
and a segment that continues from step c *supersedes* every record of a later step of the
lineage it leaves. `verify` follows the chain in file order, recomputes superseded records
too (they happened: a rollback's skipped data was drawn by them) and reports them; the final
lineage is what the last checkpoint descends from. A rollback keeps the loader where it was
(`train.reliability.rollback.LossSpikeRollback.handle_spike`), so its segment must start at the
position after the spike step, and the skip range its incident records must be [position
after step c, position after the spike): both are checked.

Verification (`python -m train.ledger verify RUN`, torch-free). It rebuilds the
global order of each segment with the loader's own code (`dataloader.global_order`,
`dataloader.stream`: there is no second implementation of the order) as one rank with a
local batch of one whole step, which yields the same rows and the same position after the
step as any number of ranks (a round of W x B sequences is "the next W x B outside the skip
ranges"), and compares every step's digest, position and counters. The parameters come
from the segment record, checked against what can be checked independently: the manifests'
content hashes on disk; the skip ranges against the config's `skip_sequences` plus the
first k rollbacks of RUN/incidents.jsonl, and the quarantined windows against its first q
quarantine records, applied by the rule a resume applies (`dataloader.incidents`); the last
segment's against RUN/config.toml (the schedule through `global_order.schedule_from_steps`,
the rule train/build.py applies); and
the position at each resume against the ledger's own record of the checkpointed step. A
finding is one line; the exit status is 1 at the first mismatch (naming the step) or at a
gap (steps the ledger cannot vouch for, e.g. a run resumed from a checkpoint written before
it had a ledger, or a final lineage that ends before the newest complete checkpoint: the
recorder has every record up to a step on disk before that step's save begins, so a
ledger behind it had its tail cut), 0 when every step of the final lineage verified.

`which RUN --step N` plans step N from the position recorded before it and names each
row's documents through documents.npy and the manifest's provenance (source file and
record, `dataloader.provenance`). `coverage RUN` counts per dataset, by interval arithmetic
over the windows (never per token), the input tokens trained once and more than once within
an epoch (must be 0), skipped (skip ranges; group cuts, block tails and quarantined windows;
steps whose update was not applied) and not reached yet. Costs: scripts/bench_ledger.py,
docs/bench/ledger-2026-11-24.md.

Where each job lives:
- `train.ledger.recorder`: the trainer's side (`DataLedgerRecorder`): each step's row
  digest, all-reduced, into RUN/ledger.jsonl;
- `dataloader.ledger_record`: the record format and the chain (row digest, positions,
  `OrderParameters`, `LedgerWriter`, and `StepTap`, which the loader feeds), shared by the
  writer and every reader; it stays beside the loader, which imports it;
- `train.ledger.__main__`: the `verify|which|coverage` command and its printing;
- `train.ledger.checks`: each segment's claims against the manifests, the incidents
  and RUN/config.toml (read through `train.config.load_config`, the trainer's own reader);
- `train.ledger.replay`: the walk and the recomputation of every step;
- `train.ledger.readers`: `which` and `coverage`.
"""
