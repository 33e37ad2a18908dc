"""The bottom floor: helpers every package shares, standard library only.

Imports flow one way, common <- dataloader <- train <- eval <- scripts, so every package
may import this one and it imports nothing of ours (nor numpy, torch or tokenizers:
`--help` of every command, `dataloader.prepare`'s worker processes and the SLURM helpers
use it without paying for them). `tests/test_architecture.py` enforces both.

- `common.io`: atomic writes, JSONL appends, a free port, `run_cli`'s one-line errors.
- `common.exit_codes`: the one table of our exit codes (`ExitCode`).
- `common.run_layout`: the RUN/ folder contract (file names, `step-N` checkpoints, the
  one answer to "is this checkpoint complete", the one metrics.jsonl reader).
- `common.run_lease`: one live run per run folder (`RUN/lease.json`, with heartbeats).
- `common.process`: process lifetimes: whether a PID still runs, and a process that ends
  with its parent (the checkpoint daemon, a torchrun worker and its launcher).
- `common.launch_env`: the launchers' environment defaults, for them and `python -m train`.
"""
