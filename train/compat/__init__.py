"""Compatibility: where a run differs by machine or by library version, and nowhere else.

- `train.compat.cpu_compat`: the only place a CPU run differs from a GPU run (device type
  and module, gloo, fp32 parameters, the FP8 capability check, missing CPU kernels); its
  numbered list says why each difference is a true device difference;
- `train.compat.version_compat`: the gaps between the pinned torch and torchtitan, filled
  on every device;
- `train.compat.amd_compat`: what differs on AMD GPUs: the FP8 format (fnuz on gfx942,
  MI300X/MI325X), and MXFP8, which torchtitan's converter does not accept there yet. It
  patches nothing: `train.build` asks it, as it asks `cpu_compat`.

The first two are applied once per process by `train.runtime.prepare_runtime`, before torchtitan's
trainer is imported. tests/train/compat/test_fork_points.py lists every place that asks
whether there is an accelerator, so a new fork is a deliberate change.
"""
