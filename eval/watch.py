"""`python -m eval.watch RUN/ [--once]`: evaluate every new complete checkpoint of a run.

For each `RUN/checkpoint/step-N` that has DCP's `.metadata` (written last, so its presence
means the save finished) and is not yet in `RUN/eval/done.json`: export to
`RUN/eval/hf/step-N` (streaming, shard by shard: a 70B checkpoint needs one shard of RAM,
not the model; see eval/export.py), start a vLLM server on it, run the tasks (each by one
engine, as `python -m eval` does) and the held-out loss (TensorBoard scalars into `RUN/tb`
at step N, results in `RUN/eval/step-N/`), stop the server, then record the step in
`done.json` (atomically), so a restarted watcher skips it. A failed step is reported and
retried on the next poll, not recorded as done.

The vLLM flags of `eval.serve` (TP/PP sizes, `--quantization`, `--kv-cache-dtype`, ...) and
the lm-evaluation-harness flags of `python -m eval` (`--lm-eval TASKS`, ...) pass through to
each step's server and evaluation; they are checked once, before the first export.

Its `--help` imports no torch (a test checks it): the exporter, which needs torch, is imported
when a watch starts, so the help of an HTTP-and-files command stays instant.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from common.exit_codes import ExitCode
from common.io import ArgumentParser, run_cli, write_json_atomic
from common.noise import filter_known_noise
from common.run_layout import (
    CHECKPOINT_DIR,
    CONFIG,
    EVAL_DIR,
    TB_DIR,
    checkpoint_dir,
    list_checkpoints,
    step_dir_name,
)
from eval.kv_cache import check_fp8_kv_cache
from eval.lm_eval_bridge import LmEvalPlan, add_lm_eval_arguments, lm_eval_kwargs
from eval.runner import EvalConfig
from eval.serve import (
    ServerError,
    VLLMServer,
    add_vllm_arguments,
    check_vllm_flags,
    cuda_available,
    vllm_kwargs,
)
from train.config import load_config


def evaluate_step(
    run: Path, step: int, vllm: dict, max_shard_size: str | None, lm_eval: dict
) -> dict:
    """Export, serve and evaluate one step; `vllm`: VLLMServer keyword arguments (serve.
    vllm_kwargs), `lm_eval`: EvalConfig's task ones (lm_eval_bridge.lm_eval_kwargs),
    `max_shard_size` None is the exporter's default."""
    from eval.export import export_checkpoint

    hf = export_checkpoint(
        checkpoint_dir(run, step),
        run / EVAL_DIR / "hf" / step_dir_name(step),
        force=True,
        max_shard_size=max_shard_size,
    )
    out = run / EVAL_DIR / step_dir_name(step)
    with VLLMServer(hf, log_path=out / "server.log", **vllm) as server:
        return EvalConfig(
            server=server.url,
            out=out,
            checkpoint_step=step,
            logdir=run / TB_DIR,
            train_run=run,
            attention_backend=server.attention_backend,
            serving=server.settings(),
            **lm_eval,
        ).build()


def watch(
    run: Path,
    once: bool,
    poll_s: float,
    vllm: dict | None = None,
    max_shard_size: str | None = None,
    lm_eval: dict | None = None,
) -> int:
    from eval.export import parse_size

    vllm, lm_eval = vllm or {}, lm_eval or {}
    if max_shard_size is not None:
        parse_size(max_shard_size)  # a bad size fails now, not at the first checkpoint
    if not (run / CONFIG).is_file():
        raise ValueError(
            f"{run}: not a run folder (no config.toml); pass the RUN of a training run"
        )
    load_config(run / CONFIG)  # a damaged one fails now, not once per checkpoint
    check_vllm_flags(**vllm)  # the flags fail now, not after the first export
    if vllm.get("kv_cache_dtype") == "fp8":
        check_fp8_kv_cache(cuda_available(), head_dim=None)  # the device; the model's later
    if lm_eval.get("lm_eval_tasks"):
        # unknown task names or a missing extra fail now, not after the first export
        LmEvalPlan.prepare(
            lm_eval["lm_eval_tasks"], lm_eval["lm_eval_include"], lm_eval["lm_eval_limit"]
        )
    num_failed, done_path = 0, run / EVAL_DIR / "done.json"
    while True:
        done = json.loads(done_path.read_text()) if done_path.is_file() else {}
        # DCP steps only: torchtitan's HF-format saves are complete for the trainer (it
        # can resume from them), but only a DCP step can be exported
        complete, incomplete = list_checkpoints(run / CHECKPOINT_DIR, dcp_only=True)
        todo = [s for s in complete if str(s) not in done]
        if incomplete:
            print(
                f"eval.watch: {len(incomplete)} incomplete checkpoint(s) (no .metadata yet), "
                f"not evaluated: steps {incomplete}",
                file=sys.stderr,
            )
        for step in todo:
            print(f"eval.watch: step {step}: export, serve, evaluate", file=sys.stderr)
            try:
                summary = evaluate_step(run, step, vllm, max_shard_size, lm_eval)
            except (ValueError, ServerError) as e:
                num_failed += 1
                print(f"eval.watch: step {step} failed: {e}", file=sys.stderr)
                continue
            heldout = summary.get("heldout") or {}
            done[str(step)] = {
                "finished_at": time.time(),
                "heldout_loss": heldout.get("loss"),
                "export_ok": heldout.get("export_ok"),
                "trainer_val_step": heldout.get("trainer_val_step"),
                "lm_eval": (summary.get("lm_eval") or {}).get("tasks"),
            }
            write_json_atomic(done_path, done)
        if once:
            return ExitCode.FAILED if num_failed else ExitCode.OK
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    filter_known_noise()  # before torchao is imported: see common/noise.py
    p = ArgumentParser(prog="python -m eval.watch", description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="the run folder RUN")
    p.add_argument("--once", action="store_true", help="process what is there, then exit")
    p.add_argument("--poll", type=float, default=60.0, help="seconds between scans")
    p.add_argument(
        "--max-shard-size",
        help="largest safetensors file of each export (default: python -m eval.export's)",
    )
    add_vllm_arguments(p)
    add_lm_eval_arguments(p)
    args = p.parse_args(argv)

    def body() -> int:
        lm_eval = lm_eval_kwargs(args)  # first: offline before the exporter imports the hub's
        vllm = vllm_kwargs(args)
        return watch(args.run, args.once, args.poll, vllm, args.max_shard_size, lm_eval)

    try:
        return run_cli(body)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
