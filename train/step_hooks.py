"""`StepHook`: what `train.trainer.RunTrainer` calls around torchtitan's step, in one order.

Why: every piece of run health, preemption and FP8 bookkeeping used to be built by the
trainer and called by name at its point of the step, in an order written only in an essay.
Each is now a hook: a class in its own wing that implements the points below, built by its
`from_trainer(trainer)` (it takes what it needs off the built trainer, as OLMo-core's
callbacks read `self.trainer`), and `train.build.step_hooks` picks the ordered tuple from
the run's config. The trainer builds none of them and names none: at each point it calls
every hook in the tuple's order (as OLMo-core's trainer runs its callbacks and torchtitan's
torchft trainer its hooks), so the order of the tuple is the order of the step, and
tests/train/test_step_order.py states it.

The points, in the order a step reaches them:
- `begin_step(step)`: before torchtitan's step;
- `on_batch(labels)`: each micro-batch as it is drawn (torchtitan draws a step's
  micro-batches before the first forward pass);
- `before_forward()` and `after_backward(loss)`: around each micro-batch's forward and
  backward pass;
- `lanes()`: what this hook sends in the step's one exchange (`train.reliability.exchange`:
  keys of its `StepReport`), read inside the optimizers' veto;
- `judge(step, loss)`: the step's global loss, summed by that exchange; the first hook that
  answers True vetoes the update (the later ones are not asked);
- `end_step()`: after torchtitan's step, also when it raised;
- `after_step(step, skipped=, sums=)`: after a step that completed: `skipped` if a hook's
  `vetoed` says so, `sums` the step's exchange (None if it made none);
- `at_boundary(step)`: at each step boundary, after the step's save and validation;
  (signal, reason) when the run must save this step and stop (a preemption);
- `state_dict()` / `load_state_dict(state)`: the hook's keys of the trainer's state (a
  checkpoint holds them), and the trainer's state after a checkpoint load (a resume, a
  rollback; `state["step"]` is the loaded step);
- `metrics(step)`: the hook's numbers for a logged step; `close()`: at the trainer's close.

`stop` is why the run must stop as diverged ("" while it need not), `vetoed` whether this
hook vetoed the current step's update (the ledger records such a step as skipped). A class
that subclasses `StepHook` inherits a no-op for every point it leaves out.
"""

from __future__ import annotations

from typing import Any, Protocol


class StepHook(Protocol):
    stop: str = ""
    vetoed: bool = False

    def begin_step(self, step: int) -> None: ...
    def on_batch(self, labels) -> None: ...
    def before_forward(self) -> None: ...
    def after_backward(self, loss) -> None: ...
    def end_step(self) -> None: ...
    def after_step(self, step: int, *, skipped: bool, sums) -> None: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...

    def lanes(self) -> dict[str, Any]:
        return {}

    def judge(self, step: int, loss: float) -> bool:
        return False

    def at_boundary(self, step: int) -> tuple[int, str] | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def metrics(self, step: int) -> dict[str, float]:
        return {}


def each(hooks, point: str, *args, **kwargs) -> list:
    """`point` called on every hook, in the tuple's order; their answers."""
    return [getattr(hook, point)(*args, **kwargs) for hook in hooks]


def merged(hooks, point: str, *args) -> dict:
    """The dicts `point` answers on every hook, merged in the tuple's order."""
    return {key: value for answer in each(hooks, point, *args) for key, value in answer.items()}
