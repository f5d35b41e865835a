"""The recorded order of a stream's units: which unit an iteration uses when.

The first training iteration (forward, recomputes, backward) is recorded; later ones follow it,
so the window knows which units come next. A unit used out of turn is a miss: the place moves to
its next use in the trace, or, when there is none, off the trace, and the rest of the iteration
runs on demand. The trace is also the daemon's schedule, so that its planner brings NVMe-homed
units into host memory before their turn; the hooks announce each step by the schedule's cursor.

The schedule is declared once: each range of a unit is named as the pair of its two versions with
a version bit of its own, which the stream sets as a step makes the other version current (a
store into shared memory). Only a new layout (new ranges) declares it again.
"""
from typing import Iterator, List, Optional

from .. import _abi
from ..client import Access, Tier
from ._figures import StreamFigures
from ._units import Range, Unit, Units


class Trace:
    def __init__(self, units: Units, figures: StreamFigures):
        self.units = units
        self.order: Optional[List[int]] = None  # unit indices over the recorded iteration
        self._recording: List[int] = []  # this iteration's, so far
        self._pos = 0                    # where this iteration is in `order`
        self._figures = figures
        self.declared = False   # `order` is the daemon's schedule
        self._stale = False     # to be declared again as the next iteration starts
        self._paired = False    # declared with pairs: versions follow by their bits
        self._cursor_base = 0   # the schedule's cursor at this iteration's start
        self._untraced: Optional[int] = None  # the last unit a forward without gradients used
        self._forward_order: List[int] = []  # _forward()'s answer for the trace `_forward_of`
        self._forward_of: Optional[List[int]] = None

    def pass_by(self, u: Unit) -> None:
        """A forward without gradients (evaluation, generate) uses u: not recorded, but what
        comes next is the forward's next unit."""
        self._untraced = u.index

    def follow(self, u: Unit) -> None:
        """Moves this iteration's place to u's use (a miss when it is not next)."""
        self._untraced = None
        self._recording.append(u.index)
        order = self.order
        if order is None:
            return
        if len(self._recording) == 1 and self._stale:  # an iteration starts after a step
            self.declare()
        at = None
        if self._pos < len(order) and order[self._pos] == u.index:
            at = self._pos
        else:
            self._figures.trace_misses += 1
            for k in range(self._pos, len(order)):
                if order[k] == u.index:
                    at = k
                    break
        if at is None:
            self._pos = len(order)  # off the trace: on demand until the iteration ends
            return
        self._pos = at + 1
        if self.declared:
            self.units.client.begin_step(self._cursor_base + at)

    def upcoming(self, in_backward: bool) -> Iterator[Unit]:
        """The units the trace says come next (before the first trace: forward's order, then
        backward's). In a forward without gradients: the forward's units after the last one it
        used (the trace's forward, else the units' order), to its end: each forward of a
        generate leaves the window empty."""
        units = self.units
        if self._untraced is not None:
            forward = self._forward()
            if self._untraced in forward:
                for index in forward[forward.index(self._untraced) + 1:]:
                    yield units[index]
            return
        if self.order is not None:
            for k in range(self._pos, len(self.order)):
                yield units[self.order[k]]
            return
        last = self._recording[-1] if self._recording else -1
        if not in_backward:
            for i in range(last + 1, len(units)):
                yield units[i]
        for i in range(last - 1 if in_backward else len(units) - 1, -1, -1):
            yield units[i]

    def _forward(self) -> List[int]:
        """The units a forward uses, in its order: the trace's up to its first repeat (the last
        block of forward is the first of backward), else every unit in order. Made once per
        trace: each use of a forward without gradients asks for it."""
        if self.order is None:
            return list(range(len(self.units)))
        if self._forward_of is not self.order:
            forward: List[int] = []
            seen = set()
            for index in self.order:
                if index in seen:
                    break
                seen.add(index)
                forward.append(index)
            self._forward_order, self._forward_of = forward, self.order
        return self._forward_order

    def scheduled_ahead(self) -> bool:
        """Whether the daemon's planner brings the units still to come up (the schedule is
        declared and this iteration is on it)."""
        return self._untraced is None and self.declared and self._pos < len(self.order)

    def end_iteration(self) -> None:
        """An iteration's backward ended: the first one becomes the trace."""
        self._figures.iterations += 1
        if self.order is None and self._recording:
            self.order = self._recording
            self.declare()
        elif self.declared:
            self._cursor_base += len(self.order)
        self._recording = []
        self._pos = 0
        self._untraced = None

    def abandon_iteration(self) -> None:
        """An iteration that raised: it is not recorded, the next one starts afresh."""
        self._recording = []
        self._pos = 0

    def laid_out(self) -> None:
        """Units were laid out anew (other ranges): declared again as the next iteration starts."""
        self._stale = True

    def flipped(self, r: Range) -> None:
        """Range r's current version changed (a step): a schedule with pairs follows through r's
        version bit, without a call; one without is declared again as the next iteration
        starts."""
        if self.declared and self._paired and r.version_bit is not None:
            self.units.expect(r, r.current)
        else:
            self._stale = True

    def declare(self) -> None:
        """The trace as the daemon's schedule: step k of an iteration reads the current versions
        of the k-th unit the trace names, each range as the pair of its versions picked by its
        version bit, and its chunk of a shared base (what is at home in host memory is held and
        not named)."""
        self._stale = False
        nvme = [u for u in self.units if u.on_nvme()]
        if not nvme:
            return
        ranges = [r for u in nvme if u.home == Tier.NVME for r in u.ranges if not r.in_base]
        self._paired = len(ranges) <= _abi.VERSION_BITS  # else the current chunks, as they are
        for bit, r in enumerate(ranges):
            r.version_bit = bit if self._paired else None
            self.units.expect(r, r.current)
        steps = []
        for index in self.order:
            u = self.units[index]
            step = []
            if u.home == Tier.NVME and self._paired:
                step = [(u.chunks.ids[0], Tier.HOST, Access.READ, u.chunks.ids[1], r.version_bit)
                        for r in u.ranges if not r.in_base]
            elif u.home == Tier.NVME:
                step = [(u.chunk_id(v), Tier.HOST, Access.READ)
                        for v in sorted({r.current for r in u.ranges if not r.in_base})]
            if u.base is not None and u.base.home == Tier.NVME:  # never flipped: no pair
                step.append((u.base.id, Tier.HOST, Access.READ))
            steps.append(step)
        self.units.client.set_schedule(steps)
        self.declared = True
        self._cursor_base = 0
        self._figures.schedules += 1
