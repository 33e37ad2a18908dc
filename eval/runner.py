"""Our runner: the held-out loss against a vLLM server, then lm-evaluation-harness's tasks
(eval/lm_eval_bridge.py: the shipped ones, `--lm-eval` names and `--tasks` files), then
the outputs of both.

Which engine scores what (docs/eval.md): lm-evaluation-harness scores every task, ours
and its own: it is the harness users report, and two scorers of one task file would only
have to be held equal. This runner keeps what lm-eval cannot do through the server: the
held-out loss on the trainer's own validation windows, token for token, checked against
the trainer's `val_loss` (the export check), at other window lengths and per position
quarter.

Outputs, under `--out DIR`:
- `summary.json`: held-out loss/perplexity and its check against the trainer's
  validation loss (and, per `seq_lens`, the held-out loss at each window length with its
  loss per position quarter: `heldout.by_seq_len`), the served folder and step, the
  attention backend and the vLLM serving settings (`serving`: TP/PP sizes, quantization,
  max_num_seqs, memory fraction; when eval.watch started the server or `--serving` names
  eval.serve's record), and timings; lm-evaluation-harness's scores in `lm_eval`.
- `lm_eval_samples.jsonl`: lm-eval's per-example records (eval/lm_eval_bridge.py), and
  `lm_eval_tasks/`: the lm-eval task of each `--tasks` file.
- TensorBoard scalars `eval/...` in the run's TB dir at the checkpoint's step
  (`--logdir`): the held-out loss, and lm-eval's as `eval/lm_eval/TASK/METRIC`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.io import check_folder_writable, write_json_atomic
from common.run_layout import CONFIG, METRICS, read_metrics
from eval import lm_eval_bridge
from eval.client import CompletionClient
from eval.heldout import heldout_loss, load_windows

# nats. Measured 3e-4 on the debug model (bf16 serving vs the FP8 trainer); the slack is
# for larger models' bf16 drift.
DEFAULT_LOSS_TOLERANCE = 0.05
DEFAULT_SEQ_LEN = 256  # held-out window length without --train-run
SEQ_LEN_FLAG = "--heldout-seq-len"


@dataclass
class EvalConfig:
    server: str
    task_files: list[Path] = field(default_factory=list)
    out: Path = Path("eval_out")
    checkpoint_step: int | None = None
    logdir: Path | None = None
    concurrency: int = 8
    connect_timeout_s: float = 30.0
    request_timeout_s: float = 300.0
    api_key: str | None = None
    heldout: Path | None = None
    heldout_windows: int = 16
    # held-out window lengths; None: the run's training.seq_len (else DEFAULT_SEQ_LEN)
    seq_lens: list[int] | None = None
    train_run: Path | None = None
    loss_tolerance: float = DEFAULT_LOSS_TOLERANCE
    attention_backend: str | None = None  # known when eval.watch started the server
    # VLLMServer.settings(): TP/PP sizes, quantization, max_num_seqs, memory fraction
    serving: dict[str, Any] | None = None
    # lm-evaluation-harness task names (eval/lm_eval_bridge.py); None: not run
    lm_eval_tasks: list[str] | None = None
    lm_eval_include: list[Path] = field(default_factory=list)
    lm_eval_limit: int | None = None

    def __post_init__(self) -> None:
        """The flags, checked before the server is waited for, not after."""
        for flag, value, low in (
            ("--concurrency", self.concurrency, 1),
            ("--heldout-windows", self.heldout_windows, 1),
            ("--connect-timeout", self.connect_timeout_s, 1e-3),
            ("--request-timeout", self.request_timeout_s, 1e-3),
        ):
            if value < low:
                raise ValueError(f"{flag} {value}: must be at least {low:g}")
        if self.heldout is not None and not Path(self.heldout).is_dir():
            raise ValueError(f"--heldout {self.heldout}: no such folder; pass a split, DATA/val")
        check_folder_writable(self.out, "--out")

    def build(self) -> dict[str, Any]:
        """The held-out loss, then lm-eval's tasks when there are any (outside the event
        loop: lm-eval runs its own), then the outputs, all at once."""
        plan = None
        if self.lm_eval_tasks:
            # names and task files checked before any request
            plan = lm_eval_bridge.LmEvalPlan.prepare(
                self.lm_eval_tasks,
                self.lm_eval_include,
                self.lm_eval_limit,
                self.task_files,
                self.out / "lm_eval_tasks",
            )
        summary, model_id = asyncio.run(run_eval(self, lm_eval=plan is not None))
        if plan is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            folder, max_len = Path(summary["served_model"]["folder"]), summary["max_model_len"]
            args = lm_eval_bridge.model_args(
                self.server, model_id, folder, max_len, self.concurrency, self.request_timeout_s
            )
            summary["lm_eval"] = lm_eval_bridge.run(plan, args, self.api_key, self.out)
            summary["timings"]["total_s"] += summary["lm_eval"]["seconds"]
        _write_outputs(self, summary)
        return summary


def _served_folder_info(root: str | None) -> dict[str, Any]:
    """export_info.json and config.json's max_position_embeddings (the context the model
    was built for) of the served folder, when it is on this machine."""
    info: dict[str, Any] = {"folder": root}
    if root and Path(root, "export_info.json").is_file():
        info.update(json.loads(Path(root, "export_info.json").read_text()))
    if root and Path(root, "config.json").is_file():
        config = json.loads(Path(root, "config.json").read_text())
        info["max_position_embeddings"] = config.get("max_position_embeddings")
    return info


def trainer_val_loss(train_run: Path, step: int | None) -> tuple[int, float] | None:
    """(step, val_loss) the trainer logged for `step`, else for the nearest earlier step.

    torchtitan validates after it saves, so a run killed (or preempted) between the two
    never logs the val_loss of its last checkpoint's step: the nearest earlier validation
    is then all there is, and the caller must say which step it compares against."""
    if step is None or not (train_run / METRICS).is_file():
        return None
    best: tuple[int, float] | None = None
    for row in read_metrics(train_run)[0]:  # torn lines skipped: a crash mid-write
        row_step, value = row.get("step"), row.get("val_loss")
        if value is None or row_step is None or row_step > step:
            continue
        if best is None or row_step >= best[0]:  # a resumed run's later line wins
            best = (int(row_step), float(value))
    return best


@dataclass
class _HeldoutPlan:
    """What the held-out loss replays: the split, the lengths, and how the trainer's own
    validation read it (`reading`: `load_windows`' windows, seed, block sizes), so its
    length matches it exactly."""

    split: Path
    seq_lens: list[int]
    reading: dict[str, Any]
    trainer_seq_len: int | None = None  # the length the trainer's val_loss was taken at


def _heldout_plan(config: EvalConfig) -> _HeldoutPlan | None:
    split, seq_lens = config.heldout, config.seq_lens
    reading = {"num_windows": config.heldout_windows, "seed": 1234}
    plan = _HeldoutPlan(split, [], reading)  # type: ignore[arg-type]
    if config.train_run is not None:
        from train.config import load_config

        if not (config.train_run / CONFIG).is_file():
            raise ValueError(
                f"--train-run {config.train_run}: no {CONFIG} there; pass the training run's "
                f"folder (the one holding {CONFIG} and {METRICS})"
            )
        run = load_config(config.train_run / CONFIG)
        for name in ("seed", "block_tokens", "shuffle_blocks"):
            reading[name] = getattr(run.dataloader, name)
        plan.trainer_seq_len = run.training.seq_len  # validation runs at the run's own length
        seq_lens = seq_lens or [run.training.seq_len]
        if split is None and run.validation.enable and run.validation.mix:
            split = Path(run.validation.mix[0].path)
            reading["num_windows"] = run.validation.steps * run.training.local_batch_size
    if split is None:
        return None
    plan.split, plan.seq_lens = split, list(dict.fromkeys(seq_lens or [DEFAULT_SEQ_LEN]))
    for seq_len in plan.seq_lens:
        if seq_len < 1:
            raise ValueError(f"{SEQ_LEN_FLAG} {seq_len}: a window length must be at least 1")
    return plan


def check_seq_lens(seq_lens: list[int], max_model_len: int | None, exported: int | None) -> None:
    """A window longer than the served context cannot be scored: one line, before any work."""
    if max_model_len is None:
        return
    for seq_len in seq_lens:
        if seq_len > max_model_len:
            if exported is None:  # not a local folder: only the server knows
                why = " (the server's /v1/models)"
            elif exported > max_model_len:
                why = f"; the export allows {exported}: serve it without --max-model-len"
            else:
                why = " (the export's config.json max_position_embeddings, model.max_seq_len)"
            raise ValueError(
                f"{SEQ_LEN_FLAG} {seq_len} exceeds the served model's max_model_len "
                f"{max_model_len}{why}; pass lengths up to {max_model_len}"
            )


async def run_eval(config: EvalConfig, lm_eval: bool = False) -> tuple[dict[str, Any], str]:
    """(summary, served model id); `EvalConfig.build` writes them. `lm_eval`: check,
    before the held-out loss, what lm-eval will need of the served folder."""
    started = time.time()
    plan = _heldout_plan(config)

    async with CompletionClient(
        config.server, config.concurrency, config.request_timeout_s, api_key=config.api_key
    ) as client:
        entry = await client.connect(config.connect_timeout_s)
        served = _served_folder_info(client.model_root)
        step = config.checkpoint_step if config.checkpoint_step is not None else served.get("step")
        # the served context: vLLM's /v1/models `max_model_len`, else (another server) the
        # served folder's config.json `max_position_embeddings`, when local
        limit = entry.get("max_model_len") or served.get("max_position_embeddings")
        max_model_len = int(limit) if limit else None
        if lm_eval:
            lm_eval_bridge.check_tokenizer(Path(served["folder"] or "(no served folder)"))
            if max_model_len is None:
                raise ValueError("--lm-eval needs the served context length: serve with vLLM")
        windows = []
        if plan is not None:
            check_seq_lens(plan.seq_lens, max_model_len, served.get("max_position_embeddings"))
            # every length read before any scoring: a bad split fails at once
            windows = [
                load_windows(plan.split, n, max_prompt_len=max_model_len, **plan.reading)
                for n in plan.seq_lens
            ]

        heldout = await _heldout(client, config, plan, windows, step) if plan else None
        summary = {
            "server": config.server,
            "served_model": served,
            "max_model_len": max_model_len,
            "step": step,
            "attention_backend": config.attention_backend
            or (config.serving or {}).get("attention_backend"),
            "serving": config.serving,
            "task_files": [str(f) for f in config.task_files],
            "heldout": heldout,
            "timings": {
                "total_s": time.time() - started,
                "num_requests_retried": client.num_retried,
                "concurrency": config.concurrency,
            },
        }
    return summary, client.model


async def _heldout(
    client: CompletionClient, config: EvalConfig, plan: _HeldoutPlan, windows: list, step
) -> dict[str, Any]:
    """The held-out loss at each length (`by_seq_len`); its top-level fields are those of
    the trainer's length when it is among them (checked against the trainer's val_loss),
    else of the first length."""
    by_seq_len = [await heldout_loss(client, w) for w in windows]
    lengths = [r["seq_len"] for r in by_seq_len]
    main = by_seq_len[lengths.index(plan.trainer_seq_len) if plan.trainer_seq_len in lengths else 0]
    heldout = dict(main, split=str(plan.split), by_seq_len=by_seq_len)
    heldout["trainer_seq_len"] = plan.trainer_seq_len
    found = trainer_val_loss(config.train_run, step) if config.train_run else None
    if found is not None and main["seq_len"] != plan.trainer_seq_len:
        heldout["note"] = (
            f"the trainer validated at seq_len {plan.trainer_seq_len}, which is not among "
            f"{SEQ_LEN_FLAG} {' '.join(map(str, lengths))}: no export check"
        )
        found = None
    heldout["trainer_val_loss"] = found[1] if found else None
    heldout["trainer_val_step"] = found[0] if found else None
    heldout["tolerance"] = config.loss_tolerance
    if found is not None:
        heldout["abs_diff"] = abs(heldout["loss"] - found[1])
        if found[0] == step:
            heldout["export_ok"] = heldout["abs_diff"] <= config.loss_tolerance
        else:
            # Another model (found[0] steps in): a difference is expected, so no
            # verdict on the export, only the nearest reference and why.
            heldout["export_ok"] = None
            heldout["note"] = (
                f"no trainer val_loss at step {step} (the run stopped between that "
                f"checkpoint and its validation); compared with step {found[0]}, "
                "the nearest earlier validation: no export check"
            )
    return heldout


def heldout_line(heldout: dict[str, Any]) -> str:
    """The console line: held-out loss at each length side by side, and per position
    quarter of each window (where long context should show)."""
    parts = []
    for r in heldout["by_seq_len"]:
        quarters = " ".join(
            f"{b['loss']:.3f}" if b["loss"] is not None else "-" for b in r["by_position"]
        )
        parts.append(
            f"@{r['seq_len']}: {r['loss']:.4f} ({r['num_tokens']} tokens; "
            f"by position quarter {quarters})"
        )
    return "held-out loss, nats/token  " + "  |  ".join(parts)


def _write_outputs(config: EvalConfig, summary: dict) -> None:
    config.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(config.out / "summary.json", summary)
    if config.logdir is not None:
        step = summary["step"]
        if step is None:
            raise ValueError(
                "--logdir needs the checkpoint step: pass --checkpoint-step N (the served "
                "folder has no export_info.json to read it from)"
            )
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(config.logdir)) as writer:
            if summary["heldout"]:
                writer.add_scalar("eval/heldout/loss", summary["heldout"]["loss"], step)
                writer.add_scalar("eval/heldout/perplexity", summary["heldout"]["perplexity"], step)
                for r in summary["heldout"]["by_seq_len"]:
                    writer.add_scalar(f"eval/heldout/loss_at_{r['seq_len']}", r["loss"], step)
            if summary.get("lm_eval"):
                for tag, value in lm_eval_bridge.tensorboard_scalars(summary["lm_eval"]).items():
                    writer.add_scalar(tag, value, step)
