"""The stream's side of the seam with the optimizer (_ranges.StreamParts): the two calls a range
or stream_ranges() makes up into the stream, to lay units out anew and to flip a range to its
new weights."""
from typing import Dict, List

import torch

from .._errors import FailedPrecondition
from ._trace import Trace
from ._units import Range, Unit, Units, by_dtype
from ._window import Window


class Seam:
    """The stream's side of the seam (_ranges.StreamParts): the two calls a range or
    stream_ranges() makes up into the stream."""

    def __init__(self, units: Units, window: Window, trace: Trace, ranks):
        self.units = units
        self.window = window
        self.trace = trace
        self.ranks = ranks

    def lay_out(self, layout: Dict[int, List[List[torch.Tensor]]]) -> Dict[int, List[Range]]:
        """Lays each unit (index -> lists of its parameters) out anew as one range per list, the
        rest of its parameters after them by dtype, moving the current weights. Between steps."""
        out, written = {}, []
        with self.window.lock:
            for index, groups in layout.items():
                u = self.units[index]
                if self.window.in_use(u):
                    raise FailedPrecondition("stream_parameters: units are rearranged between "
                                             "steps, not during a forward or backward")
                self.window.evict(u)  # a copy left in the window by an evaluation
                taken = {id(p) for g in groups for p in g}
                own = u.own_params()
                rest = by_dtype([p for p in own if id(p) not in taken])
                write = self.ranks is None or self.ranks.leader
                mine = {id(p) for p in own}
                values = {id(p): w for p, w in self.units.weights(u) if id(p) in mine} \
                    if write else {}
                self.units.lay_out(u, groups + rest, 1, values, write=write)
                if write:
                    written.append(self.units.write_down(u))
                out[index] = u.ranges[:len(groups)]  # gradient chunks made as gradients come
            self.trace.laid_out()
        for w in written:
            if w is not None:
                w.wait()
        if self.ranks is not None:  # the node's first rank has moved the weights
            self.ranks.barrier()
        return out

    def flipped(self, u: Unit, r: Range) -> None:
        """Range r of u has new weights: a copy of the old ones in the window goes, and the old
        version's chunk, once dead, its copies in the daemon too (the node's ranks share theirs,
        which one rank cannot tell dead), told outside the window's lock, which backward's hooks
        take."""
        with self.window.lock:
            self.trace.flipped(r)
            if not self.window.in_use(u):
                self.window.evict(u)
        if self.ranks is None:
            self.units.discard_dead(u, 1 - r.current)
