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
   checkpoint it rolled back to (still on disk: a rollback deletes only later ones), and
   the records before it, i.e. the skip ranges and quarantines in force while the run
   trained into the spike (not the incident's own range: that data is what to replay).
2. The replay (`train.forensics.replay.ForensicsTrainer`): the run's trainer, built from
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
   on-disk token range, and by source file and record through
   `train.forensics.__main__.window_documents`, the one seam to the data ledger.
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
replay's config and folder, the report, the quarantine records), `train.forensics.replay`
(the trainer that replays), `train.forensics.report` (the reading of the run folder, the
ranking and the table).
"""
