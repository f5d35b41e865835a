"""The seam between the stream and the optimizer: a streamed unit's weights as an optimizer's
ranges.

The stream tower (_trace, _window, _stream_hooks, _gather, streaming) and the optimizer tower
(_buckets up to optimizer) never import each other; they meet here, as FSDP2 and torch.optim meet
at the parameter. A stream lends what its ranges need as one StreamParts — its units, its
figures, its ranks' nodes — and registers its parameters under it; stream_ranges() lays the
units an optimizer steps out anew and hands back one StreamRange for each range. A range calls
up into the stream through the parts' seam only: lay_out (the units laid out anew, between
steps) and flipped (a range's next version became current), as the daemon's mover tells its
owner that a move settled.
"""
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..client import Access, Acquisition, Tier
from ._figures import StreamFigures
from ._storage import range_view
from ._units import Range, Unit, Units

__all__ = ["StreamParts", "StreamRange", "parts_of", "register", "stream_ranges"]


class StreamParts:
    """What a stream lends the ranges it hands an optimizer. `lay_out(layout)`: lays each unit
    (index -> lists of its parameters) out anew as one range per list and returns {index: those
    ranges}; `flipped(unit, range)`: the range's next version became current. `owner`: a weak
    reference to the stream, for the user's side (transformers' Trainer finds a model's stream
    by a parameter); nothing here calls it."""

    def __init__(self, units: Units, figures: StreamFigures, nodes, shared_base: Optional[str],
                 lay_out: Callable[[Dict[int, List[List[torch.Tensor]]]], Dict[int, List[Range]]],
                 flipped: Callable[[Unit, Range], None], owner: Any):
        self.units = units
        self.figures = figures
        self.nodes = nodes  # with share_ranks, the job's ranks by node (_ranks.Nodes); else None
        self.shared_base = shared_base
        self.lay_out = lay_out
        self.flipped = flipped
        self.owner = weakref.ref(owner)
        self.closed = False  # the stream's: set as it closes


# Every streamed parameter (by id) -> its stream's parts: how OffloadedAdamW finds them.
_STREAMED: "weakref.WeakValueDictionary[int, StreamParts]" = weakref.WeakValueDictionary()


def register(params: Sequence[torch.Tensor], parts: StreamParts) -> None:
    for p in params:
        _STREAMED[id(p)] = parts


def parts_of(p: torch.Tensor) -> Optional[StreamParts]:
    """The parts of the open stream that streams parameter p, if any."""
    parts = _STREAMED.get(id(p))
    if parts is None or parts.closed or not parts.units.streams(p):
        return None
    return parts


class StreamRange:
    """OffloadedAdamW's handle on one range of a streamed unit: its parameters laid end to end,
    the weights' current version, the next version a step writes, and a gradient chunk. The
    stream owns the layout and the version flip (publish); the optimizer reads and writes the
    unit's chunks through this handle only."""

    def __init__(self, parts: StreamParts, unit: Unit, r: Range):
        self._parts = parts
        self._unit = unit
        self._range = r
        self.params = r.params
        self._next = None   # the next version, held from next_version() to publish/discard
        self._grads = None  # the gradient chunk, held from gradients() to release_gradients
        # Set aside: written this step but not held (set_aside, set_gradients_aside); held again
        # with their contents kept.
        self._next_aside = False
        self._grads_aside = False

    @property
    def nodes(self):
        """With share_ranks, the job's ranks by node (_ranks.Nodes): the ranks of each node share
        the range's chunks, its next version is written by one rank of the node (the bucket's
        owner, or its node owner) and every rank flips it. None: the chunks are this rank's."""
        return self._parts.nodes

    @property
    def pages(self) -> bool:
        """Whether the range's unit is at home on NVMe: what it holds during a step is worth
        giving back as soon as the step is done with it (set_aside, set_gradients_aside)."""
        return self._unit.home == Tier.NVME

    def _check(self) -> Range:
        if self._parts.closed:
            raise RuntimeError("OffloadedAdamW: the parameter stream of these parameters was "
                               "closed (close the optimizer first)")
        if self._range.retired:
            raise RuntimeError("stream_parameters: these parameters were laid out anew for "
                               "another optimizer")
        return self._range

    def read(self, i: Optional[int] = None) -> torch.Tensor:
        """A copy of the current weights: all of them (flat), or parameter i's alone."""
        r = self._check()
        units = self._parts.units
        with units.holding(self._unit, r.current, Access.READ) as view:
            values = range_view(view, r)
            return (values[:r.numel] if i is None else r.slice(values, i)).clone()

    def read_into(self, out: torch.Tensor) -> None:
        """Copies the current weights, all of them, into `out` (flat: the next version's)."""
        r = self._check()
        units = self._parts.units
        with units.holding(self._unit, r.current, Access.READ) as view:
            out[:r.numel].copy_(range_view(view, r)[:r.numel])

    def write(self, flat: torch.Tensor) -> None:
        """Sets every weight of the current version from `flat`."""
        r = self._check()
        units = self._parts.units
        with units.holding(self._unit, r.current, Access.WRITE) as view:
            range_view(view, r)[:r.numel].copy_(flat.reshape(-1))

    def next_version(self) -> torch.Tensor:
        """A view of the next version (values, then extras) for a step's new weights, held until
        publish() or discard()."""
        if self._next is None:
            r = self._check()
            access = Access.WRITE if self._next_aside else Access.OVERWRITE
            view, held = self._parts.units.hold(self._unit, 1 - r.current, access)
            self._next = (range_view(view, r), held)
        return self._next[0]

    def set_aside(self) -> None:
        """The step's kernel is done writing the next version: its hold goes (the daemon may
        write it down), its contents stay for publish()."""
        self._next = _let_go(self._next)
        self._next_aside = True

    def publish(self, stepped: Sequence[bool]) -> None:
        """The next version becomes current: the new weights where `stepped`, the current ones
        copied across elsewhere (only then is the next version held again)."""
        self.complete(stepped)
        self.flip()

    def complete(self, stepped: Sequence[bool]) -> None:
        """The next version made whole: the current weights copied across where not `stepped`."""
        r = self._check()
        if not all(stepped):
            out = self.next_version()
            now = self.read()
            for i in range(len(stepped)):
                if not stepped[i]:
                    r.slice(out, i).copy_(r.slice(now, i))

    def flip(self) -> None:
        """The next version (complete) becomes current."""
        r = self._check()
        r.current = 1 - r.current
        self.discard()
        self._parts.flipped(self._unit, r)

    def discard(self) -> None:
        """Lets the next version go, unpublished (a step abandoned, or published)."""
        self._next = _let_go(self._next)
        self._next_aside = False

    def gradients(self) -> torch.Tensor:
        """A view of the gradient chunk (values, then extras), held until release_gradients()
        or set_gradients_aside()."""
        if self._grads is None:
            self._grads = self._parts.units.grads.hold(self._unit, self._check(),
                                                         keep=self._grads_aside)
        return self._grads[0]

    def gradients_aside(self) -> bool:
        return self._grads_aside

    def sum_gradients(self) -> None:
        """The gradients of the node's ranks of the range (each left in the daemon's memory by
        its backward) summed into this rank's, held: a reduce over the node, nothing moved."""
        self._parts.units.grads.sum_ranks(self._unit, self._check(), self.gradients())

    def set_gradients_aside(self, free: bool) -> None:
        """The gradients are not needed in memory now: their hold goes. `free`: nothing reads
        them again this step (the chunk goes, made anew at the next step's first gradient);
        else they are kept, and gradients() holds them again as they are."""
        self._grads = _let_go(self._grads)
        if free:
            self._parts.units.grads.free(self._range)
        self._grads_aside = not free

    def release_gradients(self) -> None:
        self._grads = _let_go(self._grads)
        self._grads_aside = False

    def gradient_sent(self, i: int) -> None:
        """Parameter i's gradient was taken off the device (and is dropped there)."""
        p = self.params[i]
        self._parts.figures.d2h_bytes += p.numel() * p.element_size()
        p.grad = None

    def edited(self, i: int) -> bool:
        """Whether gathered() changed parameter i's weights since clear_edited(i)."""
        return id(self.params[i]) in self._unit.edited

    def clear_edited(self, i: int) -> None:
        self._unit.edited.discard(id(self.params[i]))


def _let_go(held: Optional[Tuple[torch.Tensor, Optional[Acquisition]]]) -> None:
    """Releases a (view, acquisition) hold once its views are gone; None, to store back."""
    if held is not None and held[1] is not None:
        held[1].release_deferred()
    return None


def stream_ranges(keyed: List[Tuple[Any, torch.Tensor]]
                  ) -> Tuple[List[Tuple[Any, StreamRange]], List[Tuple[Any, torch.Tensor]]]:
    """The one place a streamed unit becomes an optimizer's ranges. `keyed`: (key, parameter),
    the key a parameter group's index. Each unit with a parameter among them is laid out anew:
    one range per key and dtype of its parameters there (its other parameters after them);
    returns those ranges as (key, StreamRange), keys in descending order and within a key the
    units in backward's order, and the parameters not streamed, as given. Parameters of a
    shared base are left out (frozen; refused when they require gradients). Between steps."""
    layouts: Dict[int, Dict[int, Dict[Tuple[Any, str], List[torch.Tensor]]]] = {}
    lent: Dict[int, StreamParts] = {}
    plain = []
    for key, p in keyed:
        parts = parts_of(p)
        if parts is None:
            plain.append((key, p))
            continue
        u = parts.units.unit_of(p)
        if u.in_base(p):  # read-only: never stepped, never given state
            if p.requires_grad:
                raise ValueError(f"OffloadedAdamW: a parameter of shape {tuple(p.shape)} is in "
                                 f"the shared base {parts.shared_base!r}, which is read-only: "
                                 "keep it frozen (requires_grad=False) and train adapters "
                                 "beside it")
            continue
        lent[id(parts)] = parts
        layouts.setdefault(id(parts), {}).setdefault(u.index, {}).setdefault(
            (key, str(p.dtype)), []).append(p)
    found = []
    for sid, by_unit in layouts.items():
        parts = lent[sid]
        order = {index: sorted(lists, key=lambda k: (-k[0], k[1]))
                 for index, lists in by_unit.items()}
        laid = parts.lay_out({index: [by_unit[index][k] for k in keys]
                              for index, keys in order.items()})
        for index, keys in order.items():
            u = parts.units[index]
            for k, r in zip(keys, laid[index]):
                found.append(((-k[0], sid, -index, k[1]), k[0], StreamRange(parts, u, r)))
    found.sort(key=lambda f: f[0])
    return [(key, rng) for _, key, rng in found], plain
