"""Per-step host cost of our trainer against torchtitan's bare `Trainer` (the anchor), and
of its replica groups against our trainer.

Why: `train.trainer.RunTrainer` adds work to each step of torchtitan's own (the health
check, the data ledger, the preemption flag). On a GPU what that work costs is rarely its
arithmetic. It is (1) a device-to-host sync: the host waits for every kernel it queued, and
can no longer run ahead to queue the next step's; and (2) a small collective: at 1,000+
ranks its latency, not its bytes. So this counts both per step, for the anchor, for ours
and for ours as replica groups ("replica"), on the same config, data and ranks, one after
the other in one run, and times the host's step:

- syncs: `aten._local_scalar_dense` (`.item()`, `int()`, `float()`, `bool()` of a device
  tensor) and copies from the device to the CPU, seen by a `TorchDispatchMode`. Without a
  GPU the device is the CPU, where a copy to the CPU is no copy and dispatches nothing; there
  each first host read of a tensor (`tolist`, `numpy`, `cpu`, `item`, `int()`, `float()`,
  `bool()`) is counted instead, by a `TorchFunctionMode` beside it: on a GPU each is a sync
  when its tensor lives on the device (`t.cpu().tolist()` counts once, as on a GPU). Every
  one is listed by its call site (the first frame outside torch), so a read of a tensor
  that stays on the host on a GPU too (torchtitan's `int(local_valid_tokens)`, counted on
  both sides here) is named as such;
- collectives: each c10d op (`torch.distributed`'s and the functional collectives, not
  their `wait`; torchft's process group dispatches the same ops), by name;
- RPCs: each call of torchft's `ManagerClient` (the quorum, the commit vote), by name;
- host milliseconds: wall time from one `train_step` to the next, in a second pass without
  the counting modes (they slow the host).

A step's counts run from torchtitan's `self.step += 1` to the next: its `train_step`, its
save and validation, and the `should_continue_training` at the boundary after it. Steps
that log metrics (step 1 and every `--log-freq`) are reported apart: torchtitan's own loop
reduces and reads its metrics there, and so does ours.

The anchor is torchtitan's `Trainer` with torchtitan's own components (optimizers, LR
schedulers, checkpointer, metrics, validator) built from the same `Trainer.Config`
(`anchor_config`); it shares what defines the work: the model spec (our llama3 spec and its
FP8 converters), the loss, the parallelism and our loader on the same data. Checkpoints
and validation are off in all (not per-step costs). The replica side is
`train.replica_groups.trainer.ReplicaGroupTrainer` with each rank a group of one rank
(`_as_group`): the same ranks and global batch, replicated by torchft across groups
instead of sharded by FSDP, over torchft's gloo group and a real Lighthouse (`lighthouse`).
On a GPU torchft's `should_commit` also synchronizes the device, which no op shows.

    python scripts/bench_step_overhead.py --config configs/debug.toml --data DATA \\
        [--nproc 2] [--steps 20] [--warmup 3] [--log-freq 10] \\
        [--out docs/bench/step_overhead-DATE]

tests/train/reliability/test_exchange.py runs `measure` on 2 gloo ranks and holds the
counts: at most one collective and one sync per step beyond the anchor's, and a replica
step's two RPCs, two collectives across groups and at most two syncs beyond ours.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import itertools
import json
import os
import statistics
import sys
import time
import weakref
from dataclasses import fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file under torchrun
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_common  # noqa: E402

from common.exit_codes import ExitCode  # noqa: E402
from common.io import write_json_atomic  # noqa: E402

SIDES = ("anchor", "ours", "replica")
KINDS = ("sync", "collective", "rpc")


# --------------------------------------------------------------------------- the counting


def call_site(skip: tuple[str, ...]) -> str:
    """The first frame outside torch and this script, as a repo- or package-relative
    `path:line`."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    if frame is None:
        return "?"
    name = frame.f_code.co_filename
    roots = (str(Path(skip[0]).parent) + os.sep, str(REPO) + os.sep)  # packages, repo
    name = next((name.removeprefix(root) for root in roots if name.startswith(root)), name)
    return f"{name}:{frame.f_lineno}"


class StepCounter:
    """Counts a trainer's syncs and collectives per step while active (see the module
    docstring for what counts). `host_reads`: the device is the CPU standing in for a GPU,
    so host reads of tensors count as the syncs they would be there."""

    COLLECTIVES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")

    def __init__(self, trainer, host_reads: bool) -> None:
        import torch
        import torchft
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        self.trainer = trainer
        self.events: list[tuple[int, str, str, str]] = []  # (step, kind, what, site)
        here = Path(__file__).parent
        dirs = (Path(torch.__file__).parent, here, Path(contextlib.__file__).parent)
        dirs += (Path(torchft.__file__).parent,)  # its collectives named by our caller
        skip = tuple(str(d) + os.sep for d in dirs)

        def note(kind: str, what: str, site: str | None = None) -> None:
            self.events.append((self.trainer.step, kind, what, site or call_site(skip)))

        cpu = torch.device("cpu")

        def on_device(t) -> bool:
            return isinstance(t, torch.Tensor) and t.device.type != "cpu"

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.overloadpacket.__name__
                if func.namespace in StepCounter.COLLECTIVES and not name.startswith("wait"):
                    note("collective", name)
                elif func.namespace != "aten":
                    pass
                elif name == "_local_scalar_dense":  # item(), int(), float(), bool()
                    if on_device(args[0]):  # a host tensor's is counted as a host read
                        note("sync", "item")
                elif name == "_to_copy" and on_device(args[0]):
                    if torch.device(kwargs.get("device") or args[0].device) == cpu:
                        note("sync", "copy to cpu")
                elif name == "copy_" and on_device(args[1]) and args[0].device == cpu:
                    note("sync", "copy to cpu")
                return func(*args, **kwargs)

        Tensor = torch.Tensor
        reads = {Tensor.tolist, Tensor.numpy, Tensor.cpu, Tensor.item, Tensor.__bool__}
        reads |= {Tensor.__int__, Tensor.__float__, Tensor.__index__}

        read: dict[int, weakref.ref] = {}  # tensors read already: `t.cpu().tolist()` is one

        def first_read(t) -> bool:
            seen = read.get(id(t))
            if seen is not None and seen() is t:
                return False
            read[id(t)] = weakref.ref(t)
            return True

        class HostReads(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in reads and isinstance(args[0], Tensor) and not on_device(args[0]):
                    if first_read(args[0]):
                        note("sync", func.__name__.strip("_"))
                return func(*args, **kwargs)

        self.modes = [Dispatch()] + ([HostReads()] if host_reads else [])
        self.rpc_ms: dict[str, list[float]] = collections.defaultdict(list)  # one a step

        def rpc(name: str, ms: float) -> None:
            note("rpc", name, "torchft")
            self.rpc_ms[name].append(ms)

        if getattr(trainer, "ft_manager", None) is not None:  # torchft's RPCs, by name
            manager = trainer.ft_manager.manager
            manager._client = RpcCounter(manager._client, rpc)

    def __enter__(self) -> StepCounter:
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self.modes):
            mode.__exit__(*exc)

    def per_step(self, steps: int) -> dict:
        """{step: {kind: n}} for steps 1..steps, the call sites of each kind with their
        counts over those steps, and each RPC's milliseconds, call by call."""
        counts = {s: dict.fromkeys(KINDS, 0) for s in range(1, steps + 1)}
        sites = {kind: collections.Counter() for kind in KINDS}
        for step, kind, what, site in self.events:
            if step in counts:
                counts[step][kind] += 1
                sites[kind][f"{what} @ {site}"] += 1
        sites = {k: dict(v) for k, v in sites.items()}
        return {"steps": counts, "sites": sites, "rpc_ms": dict(self.rpc_ms)}


class RpcCounter:
    """torchft's `ManagerClient` (a Rust class: wrapped, not patched), each RPC noted with
    its milliseconds."""

    def __init__(self, client, note) -> None:
        self._client, self._note = client, note

    def __getattr__(self, name: str):
        method = getattr(self._client, name)

        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._note(name.strip("_"), 1e3 * (time.perf_counter() - start))

        return call


# --------------------------------------------------------------------------- the trainers


def _as(config, cls):
    """`config` (one of our component `Config`s) as torchtitan's own `cls.Config`: the
    fields they share, nothing of ours."""
    return cls.Config(**{f.name: getattr(config, f.name) for f in fields(cls.Config) if f.init})


def anchor_config(ours):
    """torchtitan's bare `Trainer.Config` of our `RunTrainer.Config`: torchtitan's own
    components, the same model spec, loss, parallelism, loader and training settings."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.validate import Validator
    from torchtitan.trainer import Trainer

    anchor = _as(ours, Trainer)
    anchor.optimizer = _as(ours.optimizer, OptimizersContainer)
    anchor.lr_scheduler = _as(ours.lr_scheduler, LRSchedulersContainer)
    anchor.checkpoint = _as(ours.checkpoint, CheckpointManager)
    anchor.metrics = _as(ours.metrics, MetricsProcessor)
    anchor.validator = _as(ours.validator, Validator)
    return anchor


def _clocked(cls):
    """`cls` noting when each `train_step` starts (the step's host time is the gap to the next)."""

    class Clocked(cls):
        def train_step(self, data_iterator):
            self.step_starts.append(time.perf_counter())
            return super().train_step(data_iterator)

    return Clocked


def _build(side: str, run_config_path: str, overrides: list[str], folder: Path):
    from torchtitan.trainer import Trainer

    from train.build import to_trainer_config
    from train.config import load_config
    from train.replica_groups.trainer import ReplicaGroupTrainer
    from train.trainer import RunTrainer

    run = load_config(run_config_path, [*overrides, "--job.folder", json.dumps(str(folder))])
    ours = to_trainer_config(run)
    config = anchor_config(ours) if side == "anchor" else ours
    cls = {"anchor": Trainer, "ours": RunTrainer, "replica": ReplicaGroupTrainer}[side]
    trainer = _clocked(cls)(config)
    trainer.step_starts = []
    return trainer


def _run(trainer) -> None:
    try:
        trainer.train()
    finally:
        trainer.close()


def _as_group(rank: int, world_size: int) -> None:
    """This rank as replica group `rank` of `world_size`, one rank each: a world and store
    of its own (the group's torchft `Manager` meets its group there), as
    scripts/replica_groups.py launches each group as a torchrun of its own."""
    import torch.distributed as dist

    from common.io import free_port
    from train.replica_groups.manager import REPLICA_GROUP_ENV

    dist.destroy_process_group()
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # torchrun's store: the run's world
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_PORT=str(free_port()), **{REPLICA_GROUP_ENV: str(rank)})


def measure(
    rank: int,
    world_size: int,
    run_config_path: str,
    overrides: list[str],
    steps: int,
    out: str,
    rounds: int = 1,
) -> None:
    """One rank: each side counted (one pass), then timed `rounds` times, the sides in
    turn; "replica" last, each rank then a replica group of one rank (`_as_group`; the
    Lighthouse at TORCHFT_LIGHTHOUSE wants `world_size` groups). This rank's numbers to
    OUT/rank{rank}.json. `overrides`: CLI overrides of the run config."""
    import torch.distributed as dist
    from torchtitan.tools.logging import init_logger

    from train.runtime import prepare_runtime

    prepare_runtime()
    init_logger()
    work = Path(out)
    result: dict = {"rank": rank, "world_size": world_size, "count": {}}
    result["host_ms"] = {side: [] for side in SIDES}
    for group in (["anchor", "ours"], ["replica"]):
        if group == ["replica"]:
            _as_group(rank, world_size)
            overrides = [*overrides, "--replica_groups.groups", str(world_size)]
        for run in ["count", *range(rounds)]:
            for side in group:
                trainer = _build(side, run_config_path, overrides, work / f"{side}-{run}")
                if run == "count":
                    counter = StepCounter(trainer, host_reads=trainer.device.type == "cpu")
                    result["device"] = str(trainer.device)
                    with counter:
                        _run(trainer)
                    result["count"][side] = counter.per_step(steps)
                else:
                    _run(trainer)
                    starts = trainer.step_starts
                    ms = [1e3 * (b - a) for a, b in itertools.pairwise(starts)]
                    result["host_ms"][side].append(ms)
                dist.barrier()  # the next trainer starts together on every rank (group)
    write_json_atomic(work / f"rank{rank}.json", result)


# --------------------------------------------------------------------------- the report


def logged(step: int, log_freq: int) -> bool:
    """Whether torchtitan's metrics processor logs `step` (its `should_log`)."""
    return step == 1 or step % log_freq == 0


PAIRS = (("ours", "anchor"), ("replica", "ours"))  # (side, the side it is compared with)


def summarize(ranks: list[dict], steps: int, warmup: int, log_freq: int) -> dict:
    """Per side and kind: each measured step's count (the largest over the ranks), logged
    steps apart; per pair of `PAIRS`, the side minus the other on the same step (the most)
    and their ratio over the steps; the call sites; host ms per step (median over the
    rounds, rank 0) and its ratio."""
    measured = range(warmup + 1, steps + 1)
    chosen = {
        "unlogged": [s for s in measured if not logged(s, log_freq)],
        "logged": [s for s in measured if logged(s, log_freq)],
    }
    summary: dict = {"counts": {}, "extra": {}, "ratio": {}, "sites": {}, "host_ms": {}}
    for label, picked in chosen.items():
        for kind in KINDS:
            n = {
                side: [max(r["count"][side]["steps"][str(s)][kind] for r in ranks) for s in picked]
                for side in SIDES
            }
            key = f"{label}_{kind}"
            summary["counts"][key] = n
            summary["extra"][key] = {
                f"{a}-{b}": max((x - y for x, y in zip(n[a], n[b], strict=True)), default=None)
                for a, b in PAIRS
            }
            summary["ratio"][key] = {f"{a}/{b}": _over(sum(n[a]), sum(n[b])) for a, b in PAIRS}
    for side in SIDES:
        summary["sites"][side] = ranks[0]["count"][side]["sites"]
        host = [ms for run in ranks[0]["host_ms"][side] for ms in run[max(0, warmup - 1) :]]
        summary["host_ms"][side] = statistics.median(host) if host else None
    rpc_ms = ranks[0]["count"]["replica"]["rpc_ms"].items()  # the counting pass's
    summary["rpc_ms"] = {name: statistics.median(ms[warmup:]) for name, ms in rpc_ms}
    ms = summary["host_ms"]
    summary["ratio"]["host_ms"] = {f"{a}/{b}": _over(ms[a], ms[b]) for a, b in PAIRS}
    return summary


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def _row(what: str, cells: list[str], diffs: list[str], ratios: dict) -> str:
    for diff, ratio in zip(diffs, ratios.values(), strict=True):
        cells += [diff, "-" if ratio is None else f"{ratio:.2f}x"]
    return f"| {what} | " + " | ".join(cells) + " |"


def to_markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        *bench_common.report_header(
            report, "Per-step host cost: our trainer and its replica groups, against torchtitan's"
        ),
        f"- command: `{report['command']}`",
        f"- {report['nproc']} rank(s) on {report['trainer_device']}, {report['steps']} steps per "
        f"trainer and pass, the first {report['warmup']} left out; metrics logged at step 1 "
        f"and every {report['log_freq']}; host ms over {report['rounds']} timing round(s)",
        "",
        "| per step | anchor (torchtitan `Trainer`) | ours (`RunTrainer`) | replica "
        "(`ReplicaGroupTrainer`, each rank a group) | ours - anchor (most, same step) | "
        "ours / anchor | replica - ours (most, same step) | replica / ours |",
        "| --- |" + " ---: |" * 7,
    ]
    for key, n in s["counts"].items():
        if n["anchor"]:
            label, kind = key.split("_")
            diffs = [f"{d:+d}" for d in s["extra"][key].values()]
            lines.append(_row(f"{kind}s, {label} steps", [_span(n[x]) for x in SIDES], diffs,
                              s["ratio"][key]))  # fmt: skip
    ms = s["host_ms"]
    diffs = [f"{ms[a] - ms[b]:+.1f}" for a, b in PAIRS]
    cells = [f"{ms[side]:.1f}" for side in SIDES]
    lines.append(_row("host ms (median)", cells, diffs, s["ratio"]["host_ms"]))
    rpcs = ", ".join(f"{name} {ms:.1f}" for name, ms in s["rpc_ms"].items())
    lines += ["", f"torchft's RPCs, ms (median, rank 0, the counting pass): {rpcs}"]
    for side in SIDES:
        lines += ["", f"Call sites, {side} (rank 0, every step of the counting pass):", ""]
        for kind in KINDS:
            for site, n in sorted(s["sites"][side][kind].items(), key=lambda kv: -kv[1]):
                lines.append(f"- {kind}: `{site}`: {n}")
    return "\n".join(lines) + "\n"


def shown(argv: list[str]) -> list[str]:
    """The arguments as the report shows them: no machine paths (DATA for the data, no
    work folder)."""
    after = zip([None, *argv], argv, strict=False)  # (the argument before, the argument)
    return ["DATA" if b == "--data" else a for b, a in after if "--work-dir" not in (b, a)]


@contextlib.contextmanager
def lighthouse(groups: int):
    """torchft's Lighthouse (in this process) for the replica side's `groups` groups, at
    TORCHFT_LIGHTHOUSE for the ranks."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=groups, join_timeout_ms=100)
    os.environ["TORCHFT_LIGHTHOUSE"] = server.address()
    try:
        yield
    finally:
        os.environ.pop("TORCHFT_LIGHTHOUSE")  # a test process goes on without it
        server.shutdown()


def bench(args: argparse.Namespace, extra: list[str], raw_argv: list[str]) -> int:
    if args.data is None:
        raise ValueError("--data DATA is required: a dataloader.prepare output")
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup {args.warmup} must be below --steps {args.steps}")
    overrides = [*bench_common.data_overrides(args.data)]
    overrides += [*bench_common.measuring(args.steps, args.log_freq), *extra]
    spec = {"run_config_path": str(args.config), "overrides": overrides, "steps": args.steps}
    spec["rounds"] = args.rounds
    with bench_common.work_dir(args.work_dir, "bench_step_overhead-") as work:
        program = [str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
        program += ["--work-dir", str(work)]
        with lighthouse(args.nproc):
            bench_common.torchrun(args.nproc, program, work / "ranks.log", None)
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    report = {
        **bench_common.report_head("step_overhead", "bench_step_overhead.py", shown(raw_argv)),
        "trainer_device": ranks[0]["device"],
        **{key: vars(args)[key] for key in ("nproc", "steps", "warmup", "log_freq", "rounds")},
        "summary": summarize(ranks, args.steps, args.warmup, args.log_freq),
        "ranks": ranks,
    }
    bench_common.write_report(Path(args.out), report, to_markdown(report))
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "debug.toml")
    parser.add_argument("--data", type=Path, help="prepared DATA dir (dataloader.prepare)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (gloo on CPU), a group each")
    parser.add_argument("--steps", type=int, default=20, help="steps per trainer and pass")
    parser.add_argument("--warmup", type=int, default=3, help="leading steps left out")
    parser.add_argument("--log-freq", type=int, default=10, help="metrics.log_freq of all")
    parser.add_argument("--rounds", type=int, default=2, help="timing passes of each side")
    default_out = REPO / "docs" / "bench" / f"step_overhead-{dt.date.today().isoformat()}"
    parser.add_argument("--out", default=str(default_out), help="report stem (.md, .json)")
    parser.add_argument("--work-dir", type=Path, help="run folders, rank results (default: temp)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args, _ = bench_common.parse_known(parser, sys.argv[1:] if argv is None else argv)
    if args.worker:  # one rank under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        measure(rank, world, out=args.work_dir, **json.loads(args.worker))
        return ExitCode.OK
    return bench_common.cli(parser, bench, argv)


if __name__ == "__main__":
    sys.exit(main())
