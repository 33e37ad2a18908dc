"""The run's TOML config, in two rooms (as torchtitan splits `config/configs.py` from
`config/manager.py`):

- `train.config.schema`: every section as a dataclass, and `validate`, the cross-field
  rules every load must pass;
- `train.config.reader`: a TOML file with `extends` and command-line overrides, checked
  strictly into a `RunConfig` (`load_config`), and the resolved config written back to
  `RUN/config.toml` (`save_config`).

Torch-free: eval, the SLURM helpers, the launchers' `--check` and the ledger's verifier
(`python -m train.ledger`) read configs with it. The names below are the package's API;
eval may use `load_config` only (docs/contracts.md, section 3).
"""

from train.config.reader import from_dict, load_config, parse_override_args, save_config
from train.config.schema import (
    CheckpointConfig,
    ConfigError,
    FaultToleranceConfig,
    Fp8Config,
    HealthConfig,
    ParallelismConfig,
    ReplicaGroupsConfig,
    RunConfig,
)

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "FaultToleranceConfig",
    "Fp8Config",
    "HealthConfig",
    "ParallelismConfig",
    "ReplicaGroupsConfig",
    "RunConfig",
    "from_dict",
    "load_config",
    "parse_override_args",
    "save_config",
]
