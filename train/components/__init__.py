"""The components: our subclasses of torchtitan's trainer components, each with its own
`Config`, picked by `train.build` as torchtitan's registry picks its own, plus the
workarounds and imports they rest on.

- `train.components.checkpoint`: `RunCheckpointManager`: torn-checkpoint handling, the
  shape check, one `.metadata` read per load, preemption saves; every save in its watchdog
  window (`train.components.save_window`); `train.components.dcp_workarounds`: torch 2.13
  defects in DCP's async save, each naming what retires it;
- `train.components.hf_import`: a Hugging Face Llama folder as
  `checkpoint.initial_load_path`, recognised and checked against `[model]`, loaded through
  the shard-safe adapter;
- `train.components.optimizer`: the optimizers' update veto (the health check's);
- `train.components.validator`: validation in a watchdog window, a beat per batch;
- `train.components.metrics`: TensorBoard and RUN/metrics.jsonl;
  `train.components.fp8_stats`: FP8 numerics telemetry (`fp8.stats_freq`).

No method of a built component is reassigned (tests/train/test_no_method_patching.py):
a new per-step behaviour is a subclass here with its own `Config`.
"""
