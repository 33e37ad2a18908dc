"""`python -m eval --server URL`: evaluate a served model: the held-out loss by our runner
(eval.runner), every task (the shipped ones, `--lm-eval` names, `--tasks` files) by
lm-evaluation-harness (eval.lm_eval_bridge); docs/eval.md, "Which engine scores what"."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from common.exit_codes import ExitCode
from common.io import ArgumentParser, run_cli
from common.noise import filter_known_noise
from eval.lm_eval_bridge import add_lm_eval_arguments, lm_eval_kwargs
from eval.runner import (
    DEFAULT_LOSS_TOLERANCE,
    DEFAULT_SEQ_LEN,
    SEQ_LEN_FLAG,
    EvalConfig,
    heldout_line,
)


def read_serving(path: Path) -> dict:
    try:
        serving = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"--serving {path}: no such file; eval.serve writes serving.json beside its --log"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--serving {path}: not JSON ({e})") from None
    if not isinstance(serving, dict) or "tensor_parallel_size" not in serving:
        raise ValueError(f"--serving {path}: not an eval.serve settings record")
    return serving


def main(argv: list[str] | None = None) -> int:
    filter_known_noise()  # before torchao is imported: see common/noise.py
    p = ArgumentParser(prog="python -m eval", description=__doc__)
    p.add_argument("--server", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", type=Path, default=Path("eval_out"))
    p.add_argument("--checkpoint-step", type=int)
    p.add_argument("--logdir", type=Path, help="TensorBoard dir, e.g. RUN/tb")
    p.add_argument("--concurrency", type=int, default=8)
    # dests are EvalConfig's field names (CONNECT_TIMEOUT_S: seconds), so the parsed flags
    # are its keyword arguments
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float, default=30.0)
    p.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=300.0)
    p.add_argument("--api-key")
    p.add_argument("--heldout", type=Path, help="prepared split, e.g. DATA/val")
    p.add_argument("--heldout-windows", type=int, default=16, help="windows per length")
    p.add_argument(
        SEQ_LEN_FLAG,
        "--seq-len",
        dest="seq_lens",
        type=int,
        nargs="+",
        metavar="L",
        help="held-out window length(s), scored side by side, each at most the served "
        "max_model_len (default: the --train-run's training.seq_len, else "
        f"{DEFAULT_SEQ_LEN})",
    )
    p.add_argument(
        "--train-run",
        type=Path,
        help="RUN folder: replay its validation windows, compare with metrics.jsonl val_loss",
    )
    p.add_argument("--loss-tolerance", type=float, default=DEFAULT_LOSS_TOLERANCE)
    p.add_argument(
        "--attention-backend",
        help="recorded in the summary (eval.serve prints it; eval.watch fills it in)",
    )
    p.add_argument(
        "--serving",
        type=Path,
        metavar="SERVING_JSON",
        help="eval.serve's settings record (serving.json beside its --log): recorded in the "
        "summary (TP/PP sizes, quantization, ...)",
    )
    add_lm_eval_arguments(p)
    args = p.parse_args(argv)
    return run_cli(lambda: _evaluate(args))


def _evaluate(args: argparse.Namespace) -> int:
    lm_eval = lm_eval_kwargs(args)  # first: it takes the process offline for lm-eval
    serving = read_serving(args.serving) if args.serving else None
    fields = {f.name for f in dataclasses.fields(EvalConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields}
    summary = EvalConfig(**given | {"serving": serving} | lm_eval).build()
    printed = {"heldout": summary["heldout"]}
    if summary.get("lm_eval"):
        printed["lm_eval"] = summary["lm_eval"]["tasks"]
    print(json.dumps(printed, indent=2))
    heldout = summary["heldout"] or {}
    if heldout:
        print(heldout_line(heldout), file=sys.stderr)
    if heldout.get("export_ok") is False:
        print(
            f"error: held-out loss through the server {heldout['loss']:.4f} differs from the "
            f"trainer's val_loss {heldout['trainer_val_loss']:.4f} by more than "
            f"{heldout['tolerance']} nats: the export or the serving config is broken",
            file=sys.stderr,
        )
        return ExitCode.FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
