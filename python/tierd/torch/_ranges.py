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
import contextlib
import weakref
from typing import (Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence,
                    Set, Tuple)

import torch

from .._errors import FailedPrecondition, InvalidArgument
from ..client import Access, Acquisition, Tier
from ._figures import StreamFigures
from ._storage import range_view
from ._units import Range, Unit, Units

__all__ = ["RangeInfo", "StreamParts", "StreamRange", "parts_of", "register", "stream_ranges"]


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


class RangeInfo(NamedTuple):
    """What an optimizer reads of a range; it never reassigns a field, and edits only `edited`.

    - params: its parameters, laid end to end in this order;
    - nodes: with share_ranks, the job's ranks by node (_ranks.Nodes): the ranks of each node
      share the range's chunks, its next version is written by one rank of the node (the
      bucket's owner, or its node owner) and every rank makes it current. None: the chunks are
      this rank's;
    - pages: the range's unit is at home on NVMe, so what a step holds of it is worth putting
      aside as soon as the step is done with it (put_aside);
    - edited: ids of the parameters whose weights gathered() changed; the optimizer discards an
      id once it has taken that weight."""
    params: List[torch.Tensor]
    nodes: Any
    pages: bool
    edited: Set[int]


class StreamRange:
    """OffloadedAdamW's handle on one range of a streamed unit: its parameters laid end to end,
    the weights' current version, the next version a step writes, and a gradient chunk. The
    stream owns the layout and the version flip; the optimizer reads and writes the unit's
    chunks through these verbs only, grouped by what they hold:

    - current(): the current weights, held for a with block;
    - next(): the next version, held for a step's new weights;
    - grads(): the gradient chunk, held for the step's gradients;
    - put_aside(): a step's holds go while their contents stay, held again as they are;
    - commit(): the next version made whole and current;
    - end_step(): whatever the step still holds goes (after commit, or a step abandoned).

    gradient_sent() counts a gradient off the device for the stream's figures."""

    def __init__(self, parts: StreamParts, unit: Unit, r: Range):
        self._parts = parts
        self._unit = unit
        self._range = r
        self.info = RangeInfo(r.params, parts.nodes, unit.home == Tier.NVME, unit.edited)
        self._next = None   # the next version, held from next() to commit/put_aside/end_step
        self._grads = None  # the gradient chunk, held from grads() to put_aside/end_step
        # Where the step's gradients are held: the host, or the device for a range stepped by the
        # optimizer's device lane (grads(on_device=True)); kept until the step's end, so that
        # gradients put aside are held again where they lie.
        self._grads_tier: Optional[Tier] = None
        # Put aside: written this step but not held; held again with their contents kept.
        self._next_aside = False
        self._grads_aside = False

    def _check(self) -> Range:
        if self._parts.closed:
            raise FailedPrecondition("OffloadedAdamW: the parameter stream of these parameters was "
                                     "closed (close the optimizer first)")
        if self._range.retired:
            raise FailedPrecondition("stream_parameters: these parameters were laid out anew for "
                                     "another optimizer")
        return self._range

    @contextlib.contextmanager
    def current(self, access: Access = Access.READ) -> Iterator[torch.Tensor]:
        """The current weights, flat (values only), held for the with block: to read (READ) or
        to set (WRITE). Views of it are not to outlive the block."""
        r = self._check()
        with self._parts.units.holding(self._unit, r.current, access) as view:
            yield range_view(view, r)[:r.numel]

    def next(self) -> torch.Tensor:
        """A view of the next version (values, then extras) for a step's new weights, held until
        commit(), put_aside() or end_step(); put aside, it is held again as it was."""
        if self._next is None:
            r = self._check()
            access = Access.WRITE if self._next_aside else Access.OVERWRITE
            view, held = self._parts.units.hold(self._unit, 1 - r.current, access)
            self._next = (range_view(view, r), held)
            r.writing = True
        return self._next[0]

    def grads(self, kept_only: bool = False, on_device: bool = False) -> Optional[torch.Tensor]:
        """A view of the gradient chunk (values, then extras), held until put_aside() or
        end_step(); gradients put aside and kept are held again as they are, where they are.
        `kept_only`: only those (None when none was put aside and kept). `on_device`: the step's
        first hold takes the chunk in the device tier where there is room (CUDA memory on a
        GPU), else in the host."""
        if self._grads_tier == Tier.DEVICE and not on_device:
            # Placed on the host lane since they were held (device_share set between the
            # backward passes of one step): held again in the host, where its kernels read them.
            if self._grads is not None:
                self._grads = _let_go(self._grads)
                self._grads_aside = True
            self._grads_tier = Tier.HOST
        if self._grads is None:
            if kept_only and not self._grads_aside:
                return None
            if self._grads_tier is None:
                self._grads_tier = Tier.DEVICE if on_device else Tier.HOST
            self._grads = self._parts.units.grads.hold(
                self._unit, self._check(), keep=self._grads_aside, tier=self._grads_tier)
            self._grads_tier = Tier.HOST if self._grads[1].host else Tier.DEVICE
        return self._grads[0]

    @property
    def grads_on_device(self) -> bool:
        """Whether this step's gradients are held in the device tier."""
        return self._grads_tier == Tier.DEVICE

    def sum_node_grads(self) -> None:
        """share_ranks' node owner: the gradients of the node's ranks of the range (each left in
        the daemon's memory by its backward) summed into this rank's, held: a reduce over the
        node, nothing moved."""
        self._parts.units.grads.sum_ranks(self._unit, self._check(), self.grads())

    def put_aside(self, free: bool, weights: bool = True) -> None:
        """The step is done with what it holds for now: the gradients' hold goes — `free`:
        nothing reads them again this step (the chunk goes, made anew at the next step's first
        gradient), else they are kept — and, with `weights`, the next version's (its contents
        kept for commit). Both: the step will not be taken again, so the next forward reads the
        next version, not the current one: the daemon is told now (a hint), and keeps the new
        weights in memory rather than the old ones no forward reads."""
        if weights:
            self._next = _let_go(self._next)
            self._next_aside = True
            if free:
                self._parts.units.expect(self._range, 1 - self._range.current)
        self._grads = _let_go(self._grads)
        if free:
            self._parts.units.grads.free(self._range)
            self._grads_tier = None
        self._grads_aside = not free

    def commit(self, stepped: Optional[Sequence[bool]], flip: bool = True) -> None:
        """The next version made whole — the current weights copied across where not
        `stepped` (per parameter; None: made whole already) — and, with `flip`, current. A range
        the node's ranks share is committed in two halves: the rank that writes it makes it
        whole (flip=False) before the node's other ranks learn the flags, then every rank makes
        it current (stepped None)."""
        r = self._check()
        if stepped is not None and not all(stepped):
            out = self.next()
            with self.current() as now:
                for i, s in enumerate(stepped):
                    if not s:
                        r.slice(out, i).copy_(r.slice(now, i))
        if not flip:
            return
        r.current = 1 - r.current
        r.writing = False
        self._next = _let_go(self._next)
        self._next_aside = False
        self._parts.flipped(self._unit, r)

    def end_step(self) -> None:
        """The step is over (committed, or abandoned): the next version and the gradients are
        let go, and nothing put aside is held again. The next forward reads the current version
        (after an abandoned step too)."""
        self._parts.units.expect(self._range, self._range.current)
        self._next = _let_go(self._next)
        self._next_aside = False
        self._grads = _let_go(self._grads)
        self._grads_aside = False
        self._grads_tier = None

    def gradient_sent(self, i: int) -> None:
        """Parameter i's gradient was taken into the gradient chunk (off the device, unless the
        chunk is held there) and is dropped from the parameter."""
        p = self.info.params[i]
        if self._grads_tier != Tier.DEVICE:
            self._parts.figures.d2h_bytes += p.numel() * p.element_size()
        p.grad = None


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
                raise InvalidArgument(f"OffloadedAdamW: a parameter of shape {tuple(p.shape)} is "
                                      f"in the shared base {parts.shared_base!r}, which is "
                                      "read-only: keep it frozen (requires_grad=False) and train "
                                      "adapters beside it")
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
