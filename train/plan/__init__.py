"""The planner: a run's memory, step time and time budgets on the target GPUs, before any
GPU hour (`python -m train --dry-run`, docs/dry_run.md), and the ranking of every layout
the launch rules admit (`--dry-run --suggest`).

Its rooms, in the order a plan runs:
- `train.plan.dry_run`: the command's driver: the launch rules, then the tracer, the time
  model and the report, and the budgets it writes (`--write-budgets`);
- `train.plan.trace`: the launch's own trainer built by its constructor on torchtitan's fake
  comm backend at the real world size, one micro-batch and the optimizer step run on fake
  tensors;
- `train.plan.trackers`: how a traced step is counted (torch's memory tracker, our dispatch
  counter, the collectives by mesh); `train.plan.step_counts`: the counts themselves and the
  kernel formulas, the contract between the tracer and its readers;
- `train.plan.time_model`: step time on the target GPU (`Prediction`, which the time budgets
  read) and the held-out error its ranges come from; `train.plan.gpu_specs`: each GPU's
  memory, peaks and links (NVIDIA and AMD), with sources; `train.plan.network`: the network
  between nodes, per node, as named presets, and a collective's time over it;
- `train.plan.published`: the published runs, each with its source;
  `train.plan.calibration`: the fit of the time model's constants to them, and the error
  held out by publication and by configuration, per vendor;
- `train.plan.report`: memory allocated and reserved, the verdict (FITS, TIGHT, DOES NOT
  FIT) from the memory range, the printout;
- `train.plan.suggest`: every admitted layout, judged on one traced step per AC mode scaled
  to it, ranked by predicted tokens/s/GPU; several GPU kinds compared.

Only the front door (`python -m train`, train/__main__.py) imports the planner; the run
itself never does (tests/test_architecture.py): a launch reads the plan's predicted times
from RUN/budgets.json (`train.reliability.budgets`), not from this package.
"""
