"""`python -m train.forensics RUN --incident K`: which documents made the loss spike.

Why: a loss-spike rollback (train/reliability/rollback.py) goes back to the last checkpoint
before the spike and skips the global sequences drawn since, recording the range in
RUN/incidents.jsonl. That keeps the run alive, but says nothing about *what* spiked: the
range is a stretch of the shuffled stream, hundreds of documents wide, and the documents
come back next epoch in other windows. OLMo-core and Megatron detect spikes and re-run them;
neither explains them. This command does: it replays the spiking step exactly and ranks the
step's documents by their loss, next to the FP8 statistics the run recorded, and can
quarantine the worst so that no later epoch trains them again.

How:
1. The incident (`train.forensics.report.read_incident`): its spiking steps, the
   checkpoint it rolled back to (still on disk: a rollback deletes only later ones, and
   keep_last spares it until the incident's report exists), and
   the records before it, i.e. the skip ranges and quarantines in force while the run
   trained into the spike (not the incident's own range: that data is what to replay).
2. The replay's own plan (`train.forensics.plan`): the replay has a layout of its own
   (fewer ranks, `cp 1`), so it is never checked against the run's RUN/budgets.json (the
   plan of the run's layout, which refused every such replay); rank 0 plans its memory
   on this launch before anything is loaded, and a layout that cannot hold the model is
   refused in one line naming the world size that fits.
   The replay (`train.forensics.replay.ForensicsTrainer`): the run's trainer, built from
   RUN/config.toml by `train.build.to_trainer_config` for the world size of this launch (one
   CPU process for a CPU-sized model, `torchrun --nproc_per_node N -m train.forensics ...`
   for fewer GPUs than the run used: DCP reshards), in its own folder
   RUN/forensics/incident-K/. It loads the checkpoint with torchtitan's CheckpointManager
   (load-only: it never saves), trains the steps from there to the spike with the same
   data, LR schedule and reductions, and scores every row of the spiking steps: the loss of
   each token under the weights of that step. Layout-only overrides (`--parallelism.*`,
   `--activation_checkpoint.*`, `--compile.*`, `--comm.*`) fit it to a smaller launch.
3. The ranking (`train.forensics.report.rank_documents`): each token's loss counted for the
   document it belongs to (documents.npy; the loader's positions must restart exactly
   there), documents ranked by mean loss. Each is named by dataset, document index and
   on-disk token range, and by the source file and record prepare read it from
   (`train.ledger.readers.window_documents`: the provenance prepare writes,
   `dataloader.provenance`, which `python -m train.ledger which` reads too).
4. The report: the run's logged loss of each replayed step next to the replay's (the same
   number within fp32 tolerance: the proof that the replay reached the spike's weights),
   the ranking, and the FP8 statistics of the spiking lineage (RUN/fp8_stats.jsonl, when
   `fp8.stats_freq` recorded any between the checkpoint and the spike), as a console table
   and as RUN/forensics/incident-K.json.
5. `--quarantine-top N` (the N worst ranked documents) or `--quarantine-above LOSS` (every
   ranked document with a mean loss above LOSS) appends one `quarantine` record per
   document to RUN/incidents.jsonl: its dataset's content hash and token range. The next
   resume hands them to the loader, which passes over every window overlapping them in
   every epoch, counted as skipped (dataloader/loader.py). It takes effect at that resume,
   not in a run still training.

User errors (no such incident, the checkpoint gone, an override that would change the
numbers) are one line `error: ...` and exit 2, as `python -m train`'s.

Where each job lives: `train.forensics.__main__` (the command and its driver: the
replay's config and folder, the report, the quarantine records), `train.forensics.plan`
(the replay's memory on this launch), `train.forensics.replay` (the trainer that replays),
`train.forensics.report` (the reading of the run folder, the ranking and the table).

The checkpoint a replay starts from is kept: `checkpoint.keep_last` spares a checkpoint an
incident without a report rolled back to (`common.run_layout.unresolved_rollbacks`).
"""
