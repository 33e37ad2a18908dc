"""Reliability: what keeps a long run alive, or stops it in one line, on its own.

- `train.reliability.exchange`: the step's one fixed-size all_reduce, read once: the
  health verdict, the preemption flag and the data ledger's lanes;
- `train.reliability.health`: the per-step check on that exchange: non-finite steps
  skipped, stragglers named;
- `train.reliability.rollback`: loss spikes: back to the last checkpoint before one, the
  data since skipped exactly, incidents recorded;
- `train.reliability.watchdog`: hangs: a rank without progress in its window is dumped,
  named, and the job ends for a requeue;
- `train.reliability.budgets`: every time budget of a run (the watchdog's windows, the
  collective timeouts, SLURM's signal lead), from the plan's predicted times with the
  configured keys as floors, and the save rate the run measured;
- `train.reliability.time_limit`: the run ends itself before SLURM's end time, from its
  measured step and save (saves and exits 0, requeued as a preemption);
- `train.reliability.format_switch`: a resume in another FP8 format (a run moving between
  NVIDIA and AMD MI300X): its first losses must continue the checkpoint's, or it stops;
- `train.reliability.faults`: fault injection, for the tests of all of the above only.

docs/reliability.md lists each fault, how fast it is seen and what the user sees. This wing
imports neither the planner (`train.plan`: a launch reads the plan's times from
RUN/budgets.json) nor the components (train/components/): the components call into it
(a save opens a watchdog window, the optimizer asks the health check's veto), never the
other way (tests/test_architecture.py).
"""
