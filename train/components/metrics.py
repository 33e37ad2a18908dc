"""Metrics: torchtitan's MetricsProcessor, writing TensorBoard to RUN/tb and RUN/metrics.jsonl.

Why extend rather than replace: torchtitan already measures what matters (loss, grad norm,
tokens/s, TFLOPs, MFU, peak memory, time spent in `next()` on the loader) and logs it to
TensorBoard. We change three things:
- event files go straight into `RUN/tb/` (torchtitan adds a minute-stamped subfolder per
  launch; one folder keeps a resumed run's curves in one place for TensorBoard and eval),
- every logged step is also appended to `RUN/metrics.jsonl` with stable short names (the
  contract: step, loss, lr, grad_norm, tokens_per_s, mfu, data_wait_s, val_loss), which is
  what scripts and tests read,
- MFU is reported with FP8 too (torchtitan drops it because its peak is the BF16 one); it
  stays relative to the dense BF16 peak, so FP8 runs can exceed what BF16 could reach.
On a `fp8.stats_freq` step the line also holds train/components/fp8_stats.py's per-layer-type
summary, under its own names (`fp8/<layer type>/<operand>_<stat>`).
Data wait (torchtitan's timing around the loader's `next()`): `data_wait_s` is seconds per
optimizer step spent waiting for batches, `data_wait_frac` its share of the wall time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    TensorBoardLogger,
    _get_metrics_rank,
)

from common.io import append_jsonl
from common.run_layout import METRICS

# torchtitan metric name -> metrics.jsonl name
_JSONL_NAMES = {
    "loss_metrics/global_avg_loss": "loss",
    "loss_metrics/global_max_loss": "max_loss",
    "grad_norm": "grad_norm",
    "throughput(tps)": "tokens_per_s",
    "tflops": "tflops",
    "mfu(%)": "mfu",
    "time_metrics/end_to_end(s)": "step_time_s",
    "data_wait_s": "data_wait_s",
    "data_wait_frac": "data_wait_frac",
    "memory/max_reserved(GiB)": "memory_gib",
    "memory/max_active(GiB)": "memory_active_gib",  # peak allocated (torch's active bytes)
    "n_tokens_seen": "tokens_seen",
    "validation_metrics/loss": "val_loss",
    # dataloader (TokenShardDataLoader.metrics): input tokens dropped so far, e.g. at a seq_len change
    "data/skipped_tokens": "data_skipped_tokens",
    # ... and global sequences in skip ranges (loss-spike rollbacks, dataloader.skip_sequences)
    "data/skipped_sequences": "data_skipped_sequences",
    # ... and windows passed over as quarantined documents (train.forensics --quarantine-*)
    "data/quarantined_windows": "data_quarantined_windows",
    # train.reliability.health and train.reliability.rollback
    "health/nonfinite_skips": "nonfinite_skips",
    "health/skipped": "skipped",
    "health/straggler_rank": "straggler_rank",
    "health/straggler_lag_s": "straggler_lag_s",
    "health/step_time_spread_s": "step_time_spread_s",
    "health/data_wait_max_s": "data_wait_max_s",
    "health/rollbacks": "rollbacks",
    # the marker of a loss-spike rollback, at the spike's step (train.reliability.rollback)
    "health/rollback_to_step": "rollback_to",
    "health/rollback_skipped_sequences": "rollback_skipped_sequences",
}


class JsonlLogger(BaseLogger):
    """Appends one JSON object per `log()` call; each line is flushed and fsynced."""

    def __init__(self, path: str):
        self.path = path

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record: dict[str, Any] = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            if key in _JSONL_NAMES:
                record[_JSONL_NAMES[key]] = float(value)
            elif key.startswith("fp8/"):  # train/components/fp8_stats.py's per-layer-type summary
                record[key] = float(value)
            elif key.startswith("lr/") and "lr" not in record:
                record["lr"] = float(value)
        append_jsonl(self.path, record)


class RunMetricsProcessor(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_name: str = METRICS

    def __init__(self, config: Config, **kwargs: Any):
        super().__init__(config, **kwargs)
        # MFU against the BF16 peak is still the useful utilisation number for FP8 runs
        self.has_quantization = False
        self._last_logged_step = 0
        # set by RunTrainer: run health and rollback metrics for the interval since the last log
        self.extra_metrics_fn: Callable[[int], dict[str, float]] | None = None

    def _build_metric_logger(
        self, *, config: Config, parallel_dims, dump_folder: str, pp_schedule: str, **_: Any
    ) -> BaseLogger:
        metrics_rank = _get_metrics_rank(parallel_dims=parallel_dims, pp_schedule=pp_schedule)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank != metrics_rank:
            return BaseLogger()
        container = LoggerContainer()
        container.add_logger(JsonlLogger(os.path.join(dump_folder, config.jsonl_name)))
        if config.enable_tensorboard:
            container.add_logger(
                TensorBoardLogger(os.path.join(dump_folder, config.save_tb_folder))
            )
        return container

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        waited = sum(self.data_loading_times)
        elapsed = time.perf_counter() - self.time_last_log
        extra = dict(extra_metrics or {})
        # per optimizer step, averaged over the steps since the last log
        extra["data_wait_s"] = waited / max(1, step - self._last_logged_step)
        extra["data_wait_frac"] = waited / elapsed if elapsed > 0 else 0.0
        self._last_logged_step = step
        if self.extra_metrics_fn is not None:
            extra.update(self.extra_metrics_fn(step))
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
