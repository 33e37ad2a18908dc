"""Known harmless library noise, dropped where it is raised: one list for every entry point.

Why: the installed libraries print lines on every run that look like faults and are not
(torchao's optional kernels that cannot load here, torch's `_pytree` Enum deprecation,
`Error running lspci`, ...). A newcomer reads each as a failure. Each entry of
`KNOWN_NOISE` says who emits it and why it is harmless; `filter_known_noise()` installs a
filter on the emitting logger (or a `warnings` filter) before the library is imported.
`TRAIN_LOG_NOISE=1` shows them all again. It lives in the stdlib-only floor because
training (train/console.py), export, serving and eval all call it at start-up.
tests/train/test_console.py checks that each text still occurs in the installed library's
source, so an upgrade that rewords one fails there, naming it.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

NOISE_ENV = "TRAIN_LOG_NOISE"
ROOT_LOGGER = ""  # torchtitan logs through the root logger (torchtitan/tools/logging.py)
WARNING = None  # a Python `warnings.warn`, not a log record


@dataclass(frozen=True)
class Noise:
    """One known harmless line: who emits it, a regex its message starts with, and where the
    installed library holds its text (`source_text` is a literal part of it in `source`)."""

    emitter: str | None  # a logger name, or WARNING
    pattern: str
    source: str  # path under site-packages
    source_text: str
    why: str


KNOWN_NOISE: tuple[Noise, ...] = (
    Noise(
        "torchao",
        r"Failed to load \S*torchao/_C_\S+\.so",
        "torchao/__init__.py",
        "Failed to load ",
        "torchao's optional prebuilt kernels (_C_mxfp8: MXFP8 for Blackwell, built for "
        "CPython 3.10; _C_cutlass_90a: CUTLASS FP4/sparse kernels for sm90) cannot load here; "
        "torchao catches it and our FP8 recipes (tensorwise, rowwise: torch._scaled_mm) use "
        "neither",
    ),
    Noise(
        "torch.utils._pytree",
        r".* is an Enum subclass and is now natively supported",
        "torch/utils/_pytree.py",
        "is an Enum subclass and is now natively supported",
        "torchao registers its config enums (KernelPreference, ScaleCalculationMode) with "
        "register_constant at import; torch 2.13 handles enums natively, so the call is a no-op "
        "and the deprecation is addressed to torchao",
    ),
    Noise(
        ROOT_LOGGER,
        r"Error running lspci",
        "torchtitan/tools/utils.py",
        "Error running lspci",
        "torchtitan reads the GPU model from lspci only to pick the peak FLOPS for MFU; without "
        "lspci it uses torch's device name, which names the same GPU",
    ),
    Noise(
        ROOT_LOGGER,
        r"Peak flops undefined for: cpu,",
        "torchtitan/tools/utils.py",
        "Peak flops undefined for: ",
        "a CPU has no peak-FLOPS entry, so MFU on CPU is meaningless whatever the fallback; "
        "only 'cpu' is filtered, an unknown GPU still warns",
    ),
    Noise(
        ROOT_LOGGER,
        r"ENV\[TORCH_NCCL_ASYNC_ERROR_HANDLING\] = \d+ will be overridden to",
        "torchtitan/distributed/utils.py",
        "will be overridden to",
        "torchrun exports TORCH_NCCL_ASYNC_ERROR_HANDLING=1 and torchtitan deliberately sets its "
        "own value (3: tear the process down on a NCCL error); nothing is lost",
    ),
    Noise(
        ROOT_LOGGER,
        r"initial_load_model_only=True has no effect without an initial_load_path",
        "torchtitan/components/checkpointer/base.py",
        "initial_load_model_only=True has no effect without ",
        "torchtitan's default config; we never set initial_load_path (a run resumes from its "
        "own checkpoint folder)",
    ),
    Noise(
        ROOT_LOGGER,
        r"model\.safetensors\.index\.json not found at hf_assets_path",
        "torchtitan/protocols/state_dict_adapter.py",
        "model.safetensors.index.json not found at hf_assets_path",
        "the trainer never saves in HF format (eval.export writes the HF folder, with its "
        "own index)",
    ),
    Noise(
        WARNING,
        r"DTensor random operators may not have complete support on cpu device mesh",
        "torch/distributed/tensor/_random.py",
        "DTensor random operators may not have complete support on",
        "CPU meshes only (CI): DTensor random init falls back to each rank's generator, "
        "seeded by torchtitan, so init is deterministic and of the same distribution; GPU "
        "meshes use DTensor's RNG tracker and never print this",
    ),
    Noise(
        WARNING,
        r"DTensor manual_seed\(\) may not have complete support on cpu device mesh",
        "torch/distributed/tensor/_random.py",
        "DTensor manual_seed() may not have complete support ",
        "the same CPU-mesh fallback, at torchtitan's seeding",
    ),
    Noise(
        WARNING,
        r"Ignoring pin_memory flag for checkpoint staging",
        "torch/distributed/checkpoint/_state_dict_stager.py",
        "Ignoring pin_memory flag for checkpoint staging",
        "CPU only: pinned memory speeds up the async checkpoint's device-to-host copy, and on "
        "CPU there is no such copy",
    ),
    Noise(
        WARNING,
        r"To get the last learning rate computed by the scheduler, please use",
        "torch/optim/lr_scheduler.py",
        "To get the last learning rate computed by the scheduler, ",
        "on resume torchtitan's LRSchedulersContainer.load_state_dict recomputes the LR with "
        "get_lr() (a pure function of the restored step); torch's warning is aimed at user "
        "code reading the LR",
    ),
)


class _DropKnownNoise(logging.Filter):
    def __init__(self, patterns: list[str]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def filter_known_noise() -> None:
    """Drop `KNOWN_NOISE` at its source, unless TRAIN_LOG_NOISE=1. Call before torch and
    torchao are imported (two of the lines come at import). Filters on a logger see only
    the records created on it, so each is installed on the emitting logger itself."""
    if os.environ.get(NOISE_ENV) == "1":
        return
    by_logger: dict[str, list[str]] = {}
    for noise in KNOWN_NOISE:
        if noise.emitter is WARNING:
            warnings.filterwarnings("ignore", message=noise.pattern)
        else:
            by_logger.setdefault(noise.emitter, []).append(noise.pattern)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _DropKnownNoise)]:
            logger.removeFilter(old)
        logger.addFilter(_DropKnownNoise(patterns))
