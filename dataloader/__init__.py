"""Token-shard data pipeline: `dataloader.prepare` writes shards, `TokenShardDataLoader` reads them.

The loader (and torchtitan with it) is imported lazily, so `python -m dataloader.prepare`
and its worker processes start without importing torch.
"""

from dataloader.common import MixEntry
from dataloader.manifest import Manifest

__all__ = ["Manifest", "MixEntry", "TokenShardDataLoader"]


def __getattr__(name: str):
    if name == "TokenShardDataLoader":
        from dataloader import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'dataloader' has no attribute {name!r}")
