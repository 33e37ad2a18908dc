"""The global order: which dataset each global sequence comes from, and which rank gets it.

Why: the loader must never repeat or skip a sample across crashes, preemptions and a
change of data-parallel size, so the order of all sequences is a pure function of
(seed, manifests, mix schedule, seq_len schedule, skip ranges), computed per sequence in
O(1) memory, and everything a position depends on is a few global counters (`Cursor`),
identical on every rank. This module turns a cursor into one round of batches; each
dataset's own windows come from its `dataloader.stream.DatasetOrder`, and iteration,
prefetch and checkpoint state are `dataloader.loader`'s.

* Datasets are interleaved by weight with deterministic error feedback: global
  sequence n goes to `argmax_d(w_d * (n - o + 1) - (c_d - c_d(o)))` (ties -> lower
  index), where c_d counts the sequences dataset d has had and o is where the current
  weights took effect (the start, a `schedule` phase, or an allowed dataset change).
* Global sequences are dealt round by round: in a round of W*B sequences starting
  at cursor n, rank r takes [n + r*B, n + (r+1)*B) and every rank advances n by
  W*B. Resuming on any other (W, B) just continues from n: each sequence is used
  exactly once, with no divisibility rule. A batch has one length, so a seq_len phase
  must start on a round boundary (a training step boundary always is).
* Skip ranges (`skip_sequences`, `add_skip_ranges`): global sequences in [start, end)
  are drawn as if trained (every counter advances, each at its own phase's seq_len) and
  given to no rank; a round takes the next W*B sequences outside them. So a loss-spike
  rollback (train/reliability/health.py), a resume after it, and a run told the same ranges from the
  start all see one stream.

The planner (`GlobalOrder.plan_round`) has two paths, one dataset and a mix, whatever the
state format: a dataset's windows are only ever asked for through `DatasetOrder.advance`.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, replace
from typing import Any

from torchtitan.tools.logging import logger

from dataloader.stream import DatasetOrder, merge_ranges

Plan = list[tuple[int, int, int, int]]
"""This rank's rows of a round: (dataset, key for `read_sequence`, epoch, global sequence)."""


@dataclass(slots=True)
class SchedulePhase:
    """From global sequence `start_sequence` on, the mix uses `weights` (one per mix entry)
    and/or sequences are `seq_len` tokens long (None: unchanged from the phase before)."""

    start_sequence: int
    weights: list[float] | None = None
    seq_len: int | None = None


def schedule_from_steps(phases, sequences_per_step: int) -> list[SchedulePhase]:
    """The run config's `[[dataloader.schedule]]` phases (objects with `start_step`, 1-based,
    `weights` and `seq_len`; empty/0: unchanged) as the loader's `SchedulePhase`s.

    The one home of the rule "optimizer step S starts at global sequence (S - 1) x
    global_batch_size": a step is that many sequences whatever their length or the number
    of ranks, so a phase starts on a step boundary on any layout. train/build.py maps a
    run's config with it, and `train.ledger verify` maps RUN/config.toml with it."""
    return [
        SchedulePhase(
            start_sequence=(phase.start_step - 1) * sequences_per_step,
            weights=list(phase.weights) if phase.weights else None,  # empty: weights stay
            seq_len=phase.seq_len or None,
        )
        for phase in phases
    ]


def longest_seq_len(seq_len: int, phases) -> int:
    """The longest sequence of a run: its first `seq_len` or a phase's (objects with
    `seq_len`: the config's phases or the loader's; 0 or None keeps the length in force).
    The one home of it: the loader sizes its streams' windows to it, train/build.py gives it
    to torchtitan as `training.seq_len` (RoPE's range), the plan traces its step at it, and
    the ledger rebuilds a segment's streams with it."""
    return max([seq_len] + [p.seq_len for p in phases if p.seq_len])


@dataclass(frozen=True, slots=True)
class Cursor:
    """Global counters: everything the position in the stream depends on."""

    num_sequences: int
    per_dataset: tuple[int, ...]
    mix_origin: int
    mix_origin_per_dataset: tuple[int, ...]
    positions: tuple[Any, ...] = ()  # each dataset's position in its DatasetOrder


class GlobalOrder:
    """The rounds of one rank: the mix, the seq_len phases and the skip ranges."""

    def __init__(
        self,
        datasets: list[DatasetOrder],
        weights: list[float],
        schedule: list[SchedulePhase],
        *,
        seq_len: int,
        dp_world_size: int,
        dp_rank: int,
        local_batch_size: int,
    ):
        self.datasets = datasets
        """Each dataset's order; the loader swaps them for an older state's format."""
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.local_batch_size = local_batch_size
        # seq_len phases: the length of global sequence n (phase 0: the build's seq_len)
        self.seq_len_starts = [0] + [p.start_sequence for p in schedule if p.seq_len]
        self.seq_lens = [seq_len] + [p.seq_len for p in schedule if p.seq_len]
        # Mix phases: (first global sequence, normalised weights); phase 0 is the mix itself.
        mix_phases = [p for p in schedule if p.weights is not None]
        self.phase_starts = [0] + [p.start_sequence for p in mix_phases]
        self.phase_weights = [[w / sum(weights) for w in weights]] + [
            [w / sum(p.weights) for w in p.weights] for p in mix_phases
        ]
        self.skip_ranges: tuple[tuple[int, int], ...] = ()

    # ---- skip ranges ----------------------------------------------------------------------
    def merged_skip_ranges(self, ranges) -> tuple[tuple[int, int], ...]:
        """`skip_ranges` and these [start, end) ranges of global sequences, merged (the
        caller sets `skip_ranges` once no thread is planning)."""
        entries = sorted([list(r) for r in self.skip_ranges] + [list(r) for r in ranges])
        for entry in entries:
            if len(entry) != 2 or not 0 <= entry[0] < entry[1]:
                raise ValueError(
                    f"dataloader.skip_sequences: bad range {entry}; write [start, end) of global "
                    "sequences with 0 <= start < end, e.g. [1600, 2400]"
                )
        return merge_ranges(entries)

    def skipped_sequences(self, n: int) -> int:
        """Global sequences below `n` that lie in a skip range (never yielded)."""
        return sum(max(0, min(b, n) - a) for a, b in self.skip_ranges)

    def skipped_tokens(self, cursor: Cursor) -> int:
        """Input tokens dropped up to `cursor`, over all datasets (`DatasetOrder.skipped_tokens`)."""
        pairs = zip(self.datasets, cursor.positions, strict=True)
        return sum(order.skipped_tokens(position) for order, position in pairs)

    def _round_segments(self, n0: int, size: int) -> list[tuple[int, int, bool]]:
        """The global sequences the round at `n0` consumes, as runs (start, stop, used):
        `size` used sequences, and the skip ranges met on the way (used=False). A round that
        ends where a skip range starts leaves it to the next round."""
        segments, n, need = [], n0, size
        for start, stop in self.skip_ranges:
            if stop <= n:
                continue
            if start > n:
                take = min(need, start - n)
                segments.append((n, n + take, True))
                n, need = n + take, need - take
                if not need:
                    return segments
            segments.append((n, stop, False))
            n = stop
        segments.append((n, n + need, True))
        return segments

    # ---- seq_len phases ---------------------------------------------------------------------
    def seq_len_at(self, n: int) -> int:
        """The length of global sequence n (the seq_len phase in force there)."""
        return self.seq_lens[bisect.bisect_right(self.seq_len_starts, n) - 1]

    def _length_pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """[start, stop) cut at the seq_len phases: (first sequence, count, seq_len) each."""
        cuts = [start, *(s for s in self.seq_len_starts if start < s < stop), stop]
        return [(a, b - a, self.seq_len_at(a)) for a, b in itertools.pairwise(cuts) if b > a]

    def _round_seq_len(self, n0: int, size: int, segments) -> int:
        """The one length of the round's used sequences; a phase inside it is refused, and
        so is a length an older state's order cannot cut."""
        used = [(start, stop) for start, stop, is_used in segments if is_used]
        seq_len = self.seq_len_at(used[0][0])
        for start, stop in used:
            for first, _, length in self._length_pieces(start, stop):
                if length != seq_len:
                    raise ValueError(
                        f"dataloader.schedule: seq_len changes to {length} at global "
                        f"sequence {first}, inside the round of {size} sequences ({self.dp_world_size} "
                        f"ranks x local batch {self.local_batch_size}) starting at {n0}, and a batch has "
                        f"one length; start the phase at a multiple of {size} (a training step boundary)"
                    )
        fixed, version = self.datasets[0].fixed_seq_len, self.datasets[0].format_version
        if fixed is not None and seq_len != fixed:
            raise ValueError(
                f"dataloader: this run resumed a format-{version} state, whose order "
                f"is fixed to seq_len {fixed}; a seq_len phase ({seq_len}) needs a run started "
                "with this loader (format 3). Drop the seq_len phase, or start the data stream afresh "
                "(checkpoint.exclude_from_loading = ['dataloader'])"
            )
        return seq_len

    # ---- rounds -------------------------------------------------------------------------------
    def plan_round(self, cursor: Cursor) -> tuple[Plan, Cursor, int] | None:
        """This rank's rows in the round at `cursor` (`Plan`), the cursor after the whole
        round, and the round's seq_len; None when a stopping dataset runs out inside the
        round (it is dropped on every rank).

        A round is the next W*B global sequences outside the skip ranges; the skipped ones
        are drawn as if trained (every counter advances, each at its own phase's seq_len)
        and given to no rank, so the stream after them is the one a run that trained them
        would see."""
        size = self.dp_world_size * self.local_batch_size
        segments = self._round_segments(cursor.num_sequences, size)
        seq_len = self._round_seq_len(cursor.num_sequences, size, segments)
        # Two paths, and only two: a state format is a DatasetOrder, never a branch here
        # (a new format implements DatasetOrder; see its docstring for the rest).
        if len(self.datasets) == 1:
            planned = self._plan_one_dataset(cursor, segments, seq_len)
        else:
            planned = self._plan_mix(cursor, segments, seq_len)
        return None if planned is None else (*planned, seq_len)

    def _plan_one_dataset(self, cursor: Cursor, segments, seq_len: int):
        """One dataset: every global sequence is its next window, so each run of used or
        skipped sequences is one `advance` (cost per round: O(this rank's rows))."""
        lo = self.dp_rank * self.local_batch_size
        hi = lo + self.local_batch_size
        dataset, position = self.datasets[0], cursor.positions[0]
        plan: Plan = []
        taken = 0  # used sequences so far
        for start, stop, is_used in segments:
            if not is_used:
                for _, count, length in self._length_pieces(start, stop):
                    position = dataset.advance(position, length, count)
                continue
            count = stop - start
            first = min(max(lo - taken, 0), count)  # this rank's rows in the run
            last = min(max(hi - taken, 0), count)
            starts: list[tuple[int, int]] = []
            position = dataset.advance(position, seq_len, first)
            position = dataset.advance(position, seq_len, last - first, starts)
            position = dataset.advance(position, seq_len, count - last)
            plan += [(0, key, epoch, start + first + j) for j, (epoch, key) in enumerate(starts)]
            taken += count
        if dataset.exhausted(position):
            self._log_drop(None)
            return None
        span = segments[-1][1] - cursor.num_sequences  # used and skipped
        after = replace(
            cursor,
            num_sequences=cursor.num_sequences + span,
            per_dataset=(cursor.per_dataset[0] + span,),
            positions=(position,),
        )
        return plan, after

    def _plan_mix(self, cursor: Cursor, segments, seq_len: int):
        """A mix: the error feedback picks each global sequence's dataset, one at a time."""
        lo = self.dp_rank * self.local_batch_size
        hi = lo + self.local_batch_size
        counts, positions = list(cursor.per_dataset), list(cursor.positions)
        origin, origin_counts = cursor.mix_origin, list(cursor.mix_origin_per_dataset)
        plan: Plan = []
        i = 0  # used sequences so far
        for start, stop, is_used in segments:
            for n in range(start, stop):
                phase = bisect.bisect_right(self.phase_starts, n) - 1
                if self.phase_starts[phase] > origin:  # a schedule phase starts: new error feedback
                    origin, origin_counts = self.phase_starts[phase], list(counts)
                weights = self.phase_weights[phase]
                scores = [
                    w * (n - origin + 1) - (c - o)
                    for w, c, o in zip(weights, counts, origin_counts, strict=True)
                ]
                d = scores.index(max(scores))
                dataset = self.datasets[d]
                starts = [] if is_used and lo <= i < hi else None  # this rank's row
                length = seq_len if is_used else self.seq_len_at(n)
                positions[d] = dataset.advance(positions[d], length, 1, starts)
                if dataset.exhausted(positions[d]):
                    self._log_drop(i)
                    return None
                if starts:
                    plan.append((d, starts[0][1], starts[0][0], n))
                counts[d] += 1
                i += is_used
        end = segments[-1][1]  # after the used and skipped sequences
        return plan, Cursor(end, tuple(counts), origin, tuple(origin_counts), tuple(positions))

    def _log_drop(self, num_available: int | None) -> None:
        size = self.dp_world_size * self.local_batch_size
        available = "" if num_available is None else f"{num_available} of "
        logger.info(
            f"[TokenShardDataLoader] data exhausted on rank {self.dp_rank}: dropped the final "
            f"incomplete round ({available}{size} sequences) so every rank "
            "yields the same number of batches"
        )
