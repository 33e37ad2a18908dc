"""`python -m train`: the front door (`train.__main__`) and the run itself at this level
(`train.runtime`, `train.preflight`, `train.launch_rules`, `train.config`, `train.build`,
`train.trainer`, `train.model`, `train.attention`, `train.fp8`, `train.shards`,
`train.console`); every other job in a wing named by it: `train.plan` (the planner,
`--dry-run`), `train.components` (our torchtitan components), `train.reliability` (health,
loss-spike rollbacks, hangs, time budgets), `train.compat` (CPU and version differences),
`train.ledger` (the data ledger) and `train.forensics` (spike forensics).
docs/architecture.md draws them and who may import whom.
"""
