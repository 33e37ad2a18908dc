"""The checks a launch makes before any process starts: config, world size, data.

Why a module of its own, torch-free: the launchers (`scripts/train_local.sh`,
`scripts/slurm/submit.py`, `scripts/slurm/train.sbatch`) run these checks through
`python -m train --check` before torchrun starts, so a typo or a missing data folder is
one line in a second, not a line per rank plus torchrun's traceback after the workers
have imported torch. `python -m train` runs the same function again in every worker (a
direct `python -m train` has no launcher in front of it). A Hugging Face folder given as
`checkpoint.initial_load_path` is checked against [model] here (`train.hf_import`). Nothing here imports torch
(tested); the checks that need it (checkpoint shapes, CUDA) stay in the trainer.
"""

from __future__ import annotations

from pathlib import Path

from train.config import ConfigError, RunConfig
from train.hf_import import check_initial_load
from train.launch_rules import check_launch


def check_data(run: RunConfig) -> None:
    """Tokenizer vs model vocab, and each dataset vs the configured tokenizer."""
    from tokenizers import Tokenizer

    from dataloader import Manifest

    tokenizer_json = Path(run.dataloader.tokenizer) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ConfigError(
            f"dataloader.tokenizer: {tokenizer_json} not found; point it at DATA/tokenizer "
            "written by dataloader.prepare"
        )
    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    if vocab > run.model.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_json} has {vocab} tokens but model.vocab_size is "
            f"{run.model.vocab_size}; set model.vocab_size >= {vocab}"
        )
    entries = list(run.dataloader.mix) + (list(run.validation.mix) if run.validation.enable else [])
    for entry in entries:
        manifest = Manifest.load(entry.path)
        manifest.check_vocab(run.model.vocab_size)
        manifest.check_tokenizer(tokenizer_json)


def preflight(run: RunConfig, world_size: int) -> None:
    """Everything a launch of `world_size` ranks can check without torch; ValueError if bad."""
    check_launch(run, world_size)
    check_data(run)
    check_initial_load(run)
