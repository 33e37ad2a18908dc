"""torchft replica groups: the run goes on through the loss of a group, and every token is
still trained exactly once (docs/reliability.md, "Replica groups").

Why: without replica groups any fault ends the whole job: SLURM requeues it, every rank
reloads the last checkpoint, and up to a checkpoint interval of steps is trained again. At
Llama 3's failure rate (419 interruptions in 54 days on 16,384 GPUs) a large run loses a
visible share of its time that way. torchft (PyTorch's fault-tolerance library) trains N
copies of the model, *replica groups*, each its own torchrun, FSDP and TP inside a group,
and averages their gradients over a quorum that a Lighthouse forms afresh at every step: a
group that dies is dropped at the next step, the others train on, and a group that comes
back heals from a live peer's memory, with no checkpoint read. torchft's own data sampler
is lossy by its documentation (a down group's examples are never used); this project's
loader and ledger make it exact:

- each step's global batch is the live groups' slices of the one global order (the
  loader reshards to any data-parallel size with O(1) state, so a step is just "the next
  S slices", whatever the quorum);
- the loader's cursor advances by what committed; a step that does not commit is served
  again from its start;
- a healing group receives the loader cursor from its peer, with the model, the optimizer,
  the LR schedule and the step;
- every group records each step in its own ledger (the quorum, the size, the digest of
  all the step's rows, the commit), and `python -m train.ledger verify` merges them and
  proves exactly-once across every quorum change (`train.ledger.replicas`).

The global batch while a group is down is a config key (`replica_groups.down_policy`):
"shrink" trains the live groups' own slices (a smaller step, torchft's normalization by the
number of participants), "accumulate" has the live groups train the missing slices too
(the configured global batch, a longer step).

The rooms (each extends a torchtitan component by subclass, picked in `train/build.py`
through `build.replica_trainer_config`):
- `manager.py`: `ReplicaGroupsManager`, torchtitan's `TorchFTManager` with a synchronous
  quorum, and the one cross-group reduction per step;
- `trainer.py`: `ReplicaGroupTrainer`, our `RunTrainer` with the quorum before the data,
  the step's slices, the reduction and the commit;
- `optimizer.py`: `ReplicaOptimizersContainer`, committed by torchft, then vetoed or applied;
- `checkpoint.py`: `ReplicaCheckpointManager`, the states a peer heals from, one group saves;
- `recorder.py`: `ReplicaLedgerRecorder`, each group's RUN/replicas/G/ledger.jsonl;
- `fingerprint.py`: the weights' checksums the groups compare every few steps;
- `build.py`: the replica-group trainer config from the single run's;
- `torchft_workarounds.py`: torchft 0.2.0 defects, apart, each naming what retires it.

The launcher (`scripts/replica_groups.py`; `scripts/train_local.sh --replica-groups N`,
`scripts/slurm/submit.py --replica-groups N`) starts the Lighthouse and the groups, restarts
a group that dies, and holds the run folder's lease for its groups.
"""
