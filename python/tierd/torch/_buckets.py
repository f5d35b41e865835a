"""OffloadedAdamW's buckets: parameters stepped together as one tierd group.

A bucket holds parameters of one torch parameter group, of one dtype and device, laid end to end
in flat buffers: the gradients (filled as backward produces them) and the weights the kernel
writes. Each parameter is a tensor of the tierd group with its own step count, so a parameter
without a gradient in a step is left as it is, as torch leaves it. Sharded over ranks, each buffer
carries one more element per parameter after the values (see _shard.py): how many ranks had a
gradient for it (reduces), or whether its owner stepped it (broadcasts).

A bucket's places ("slots") are fixed when it is made. A slot is *live* while its parameter is in
the optimizer's parameter groups with this slot as its place; a parameter that leaves the groups
keeps its slot, and its state, as torch keeps `state[p]` (it is stepped again if it comes back).
A bucket with no live slot is *dormant*: it holds its parameters by weak reference only, and its
state is freed once none of its slots is the place of a parameter still alive.
"""
import ctypes
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .._errors import InvalidType
from .. import _abi
from ..client import Access
from ._storage import STEPPED_DTYPES, end_to_end
from ._buffers import Buffers, HostBuffers, RangeBuffers
from ._ranges import StreamRange, stream_ranges

_STEP, _TAKE = _abi.ADAM_TENSOR_STEP, _abi.ADAM_TENSOR_TAKE_WEIGHTS


class BucketStep:
    """What a bucket knows of one step, made fresh for each: which gradients are in `grad` (got)
    and were present on any rank (has), how many backward is expected to give (expected, set
    as the step's first gradient comes) and has given (arrived), whether every gradient it will
    get is taken (complete), the side stream's copies off a GPU (event), and whether it was
    given to the optimizer (launched)."""

    __slots__ = ("got", "has", "expected", "arrived", "complete", "event", "launched")

    def __init__(self, k: int):
        self.got = [False] * k
        self.has = [False] * k
        self.expected = 0
        self.arrived = 0
        self.complete = False
        self.event = None
        self.launched = False


class Bucket:
    def __init__(self, serial: int, name: str, group: Dict[str, Any],
                 params: List[torch.Tensor], buffers: Optional[Buffers] = None):
        self.serial = serial      # creation order: the order of collectives over ranks
        self.name = name          # the tierd group's name
        self.group = group        # the param_groups entry whose hyperparameters it steps with
        self.owner = 0
        self.slot: Optional[int] = None  # the tierd group's index in this rank's state
        self.params: Optional[List[torch.Tensor]] = list(params)  # None once dormant
        self._refs: List[weakref.ref] = []
        self.sizes, self.offsets, self.numel = end_to_end(params)
        self.dtype = params[0].dtype
        self.device = params[0].device
        k = len(params)
        # Its gradients and a step's new weights (_buffers.py): this process's, or a range's.
        self.buffers = buffers if buffers is not None else \
            HostBuffers(self.numel, k, self.dtype, pin=self.device.type == "cuda")
        self.live = [True] * k
        self.flags = (ctypes.c_uint8 * max(k, 1))()
        self.weights: Optional[torch.Tensor] = None  # fp32 weights to take, made when needed
        # Each weight's (version, data_ptr) when the optimizer last left it, and when the flags
        # of this step were set.
        self.seen: List[Tuple[int, int]] = [(-1, 0)] * k
        self.flagged: List[Tuple[int, int]] = [(-1, 0)] * k
        self.this_step = BucketStep(k)
        # Where its fp32 master weights live (_abi.ADAM_MASTER_IN_*): the state decides when it
        # gives the bucket its group (_state.OptimizerState.masters).
        self.master = _abi.ADAM_MASTER_IN_STATE
        # A master in `out` holds a launched step's new weights that the model has not taken.
        self.out_ahead = False

    # ---- the model's weights, as the optimizer reads and writes them ----

    def weight(self, i: int) -> torch.Tensor:
        """Weight i as the model has it now (flat, on the CPU)."""
        return self.params[i].detach().reshape(-1).to("cpu")

    def set_weights(self, flat: torch.Tensor) -> None:
        """Sets every weight from `flat` (this bucket's layout, any dtype)."""
        with torch.no_grad():
            for i, values in self.slices(flat):
                self.params[i].copy_(values.view_as(self.params[i]))

    def mirror(self) -> None:
        """Records the weights as the optimizer leaves them (their values and versions)."""
        if self.params is None:
            return
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self.slice(self.buffers.out, i).copy_(p.detach().reshape(-1))
                self.remember(i)

    def grads_aside(self) -> None:
        """After a read of its gradients between the kernel and the step's end: a bucket whose
        buffers page puts them aside again (the copies into them from a GPU done first)."""
        buf = self.buffers
        if buf.pages and buf.grad is not None:
            if self.this_step.event is not None:
                self.this_step.event.synchronize()
            buf.put_aside(free=False, weights=False)

    def out_can_be_master(self, device_tier: bool) -> bool:
        """Whether `out` can hold the fp32 master weights themselves (the state then keeps m and
        v only, and a step writes the weights once): fp32 weights kept outside the model's
        tensors. Here `out` is this process's fp32 copy of the weights as the optimizer left
        them (kept anyway, to tell weights the caller changed): with fp32 weights it is their
        master exactly. Not where the daemon has a device tier (`device_tier`): there the
        master stays in the state, so that device_share can step the bucket on the device."""
        return self.dtype == torch.float32 and not device_tier

    def prime_out(self) -> None:
        """Before the library steps the bucket: a master in `out` starts as the weights are.
        Here it is, unless a step stepped it and the model did not take it (a rolled-back
        speculative step): then it is set from the weights again. Weights the caller changed
        are taken by the kernel (flag())."""
        if self.master != _abi.ADAM_MASTER_IN_OUT:
            return
        if self.out_ahead:
            self.mirror()
        self.out_ahead = True

    @property
    def nodes(self):
        """Whether the ranks of each node share its weights and gradient chunks (a rank-shared
        stream's range): the ranks by node (_ranks.Nodes), else None. Such a bucket's owner
        writes the next version, the node owners on other nodes receive it, and the others only
        learn which parameters were stepped (_shard.py)."""
        return None

    def finish_next(self, flags: List[int]) -> None:
        """A shared bucket's owner, before the others learn its flags: its next version whole."""

    def sum_gradients(self) -> None:
        """A shared bucket's node owner, once the node's gradients are in: their sum in `grad`."""

    def publish(self, flags: List[int]) -> None:
        """The step's new weights in `out` (flags per parameter) into the model."""
        for i, values in self.slices(self.buffers.out):
            if flags[i] & _STEP:
                p = self.params[i]
                p.copy_(values.view_as(p), non_blocking=p.is_cuda)
            if flags[i]:
                self.remember(i)
        self.out_ahead = False

    def unbind(self) -> None:
        """The step is over (published or not): its buffers let go what they hold. A master in
        `out` that the model did not take (an abandoned or skipped step) goes back to the
        weights as they are."""
        if self.out_ahead:
            self.mirror()
            self.out_ahead = False
        self.buffers.end_step()

    @property
    def active(self) -> bool:
        return self.params is not None and any(self.live)

    def param(self, i: int) -> Optional[torch.Tensor]:
        return self.params[i] if self.params is not None else self._refs[i]()

    def go_dormant(self) -> None:
        """Holds the parameters by weak reference only (none of them is in the groups)."""
        self._refs = [weakref.ref(p) for p in self.params]
        self.params = None

    def wake(self) -> None:
        """Holds them again (one of them came back to the groups)."""
        if self.params is None:
            self.params = [r() for r in self._refs]
            self._refs = []

    def slice(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.offsets[i]:self.offsets[i] + self.sizes[i]]

    def slices(self, flat: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor]]:
        for i in range(len(self.sizes)):
            yield i, self.slice(flat, i)

    def present(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        """The slices of the parameters that have a gradient this step."""
        for i, values in self.slices(flat):
            if self.this_step.has[i]:
                yield values

    def remember(self, i: int) -> None:
        """Weight i is as the optimizer leaves it: its version, and its values in `out`."""
        p = self.param(i)
        self.seen[i] = (p._version, p.data_ptr())

    def touched(self, i: int) -> bool:
        """Whether weight i was written since the optimizer last left it (values not compared)."""
        p = self.param(i)
        return (p._version, p.data_ptr()) != self.seen[i]

    def written_since_flagged(self) -> bool:
        """Whether a live weight was written since the bucket's flags were set (flag())."""
        return any(self.live[i] and (p._version, p.data_ptr()) != self.flagged[i]
                   for i, p in enumerate(self.params))

    def changed(self, i: int) -> bool:
        """Whether the caller changed weight i since the optimizer last left it (in place, by
        `.data =`, or by a load); touched but equal is not changed."""
        if not self.touched(i):
            return False
        p = self.param(i)
        same = torch.equal(p.detach().reshape(-1).to("cpu"), self.slice(self.buffers.out, i))
        if same:
            self.remember(i)
        return not same

    def flag(self) -> bool:
        """Sets the flags of this step: stepped where a gradient is present, weights taken where
        the caller changed them. Whether there is anything to do."""
        anything = False
        for i in range(len(self.sizes)):
            f = 0
            if self.live[i]:
                p = self.params[i]
                self.flagged[i] = (p._version, p.data_ptr())
                if self.this_step.has[i]:
                    f |= _STEP
                if self.changed(i):
                    f |= _TAKE
                    if self.weights is None:
                        self.weights = torch.empty(self.numel, dtype=torch.float32)
                    self.slice(self.weights, i).copy_(self.weight(i))
            self.flags[i] = f
            anything = anything or f != 0
        return anything

    def reset_step(self) -> None:
        """The step is over: the next one starts with a record of its own."""
        self.this_step = BucketStep(len(self.sizes))


def plan(params: List[Tuple[int, Dict[str, Any], torch.Tensor]], bucket_params: int,
         first_serial: int) -> List[Bucket]:
    """Buckets for `params` ((group index, group, parameter), in the groups' order): per group, in
    backward's order (the last parameters' gradients come first), cut at a change of dtype or
    device and at bucket_params; streamed parameters are the ranges the stream lays out for them
    (_ranges.stream_ranges), first. Named "g<group index>.<serial>"."""
    buckets: List[Bucket] = []
    groups = {gi: group for gi, group, _ in params}
    ranges, plain = stream_ranges([(gi, p) for gi, _, p in params])
    for gi in sorted(groups, reverse=True):
        group = groups[gi]
        for _, rng in (kr for kr in ranges if kr[0] == gi):
            serial = first_serial + len(buckets)
            buckets.append(StreamBucket(serial, f"g{gi}.{serial}", group, rng))
        current: List[torch.Tensor] = []
        size = 0

        def close():
            serial = first_serial + len(buckets)
            buckets.append(Bucket(serial, f"g{gi}.{serial}", group, current))
        for _, p in reversed([kp for kp in plain if kp[0] == gi]):
            if current and (p.dtype != current[0].dtype or p.device != current[0].device
                            or size + p.numel() > bucket_params):
                close()
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            close()
    return buckets


def write_back(stepped: List[Bucket], active: List[Bucket], comm) -> Optional[Any]:
    """Puts a finished step's new weights (each bucket's `out`) into the model: the `stepped`
    buckets' here, or, sharded over ranks (`comm`), every `active` bucket's from its owner.
    Returns the CUDA event after the copies into GPU weights (None when there are none): `out`
    is not to be written again before it."""
    for b in stepped:  # weights only taken: `out` keeps them as the model has them
        if not any(b.flags[i] == _TAKE for i in range(len(b.sizes))):
            continue
        b.buffers.hold_next()  # held again if it was put aside
        for i, values in b.slices(b.buffers.out):
            if b.flags[i] == _TAKE:
                values.copy_(b.weight(i))
    if comm is not None:
        for b in active:  # every bucket's new weights arrive into its `out` (a shared one's
            if comm.writes_next(b):  # into its owner's and node owners' only)
                b.buffers.hold_next()
        new = comm.broadcast_weights(active, stepped)
    else:
        new = [(b, [b.flags[i] for i in range(len(b.sizes))]) for b in stepped]
    for b, flags in new:
        b.publish(flags)
    if not any(b.device.type == "cuda" for b in active + stepped):
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def check_dtype(p: torch.Tensor) -> None:
    if p.dtype not in STEPPED_DTYPES:
        raise InvalidType(f"OffloadedAdamW: a parameter of dtype {p.dtype}; float32, bfloat16 and "
                          "float16 are supported")


class StreamBucket(Bucket):
    """A bucket of streamed parameters: one range of their unit (_ranges.StreamRange). Its
    gradients are the range's gradient chunk; the step's new weights go into the range's next
    version, current from publish() on; the weights as the model has them are the current
    version."""

    def __init__(self, serial: int, name: str, group: Dict[str, Any], rng: StreamRange):
        self.range = rng
        super().__init__(serial, name, group, rng.info.params, RangeBuffers(rng))

    def weight(self, i: int) -> torch.Tensor:
        with self.range.current() as now:
            return self.slice(now, i).clone()

    def set_weights(self, flat: torch.Tensor) -> None:
        with self.range.current(Access.WRITE) as now:
            now.copy_(flat.reshape(-1))

    def mirror(self) -> None:
        if self.params is not None:
            self.range.info.edited.difference_update(id(p) for p in self.range.info.params)

    def remember(self, i: int) -> None:
        self.range.info.edited.discard(id(self.range.info.params[i]))

    def touched(self, i: int) -> bool:
        return id(self.range.info.params[i]) in self.range.info.edited

    def written_since_flagged(self) -> bool:
        return False  # its weights change only in the stream's gathered(), refused in a step

    def changed(self, i: int) -> bool:
        return self.touched(i)

    def out_can_be_master(self, device_tier: bool) -> bool:
        return self.dtype == torch.float32

    def prime_out(self) -> None:
        # Every launch, also one that steps the bucket again after a rolled-back step, whose
        # kernel left its new weights in `out`.
        if self.master == _abi.ADAM_MASTER_IN_OUT:
            with self.range.current() as now:
                self.buffers.out.copy_(now)

    @property
    def nodes(self):
        return self.range.info.nodes

    def finish_next(self, flags: List[int]) -> None:
        self.range.commit([bool(f & _STEP) for f in flags], flip=False)

    def sum_gradients(self) -> None:
        self.buffers.hold_grads()
        self.range.sum_node_grads()

    def publish(self, flags: List[int]) -> None:
        """The next version becomes current: the new weights where stepped, the current ones
        copied across elsewhere (a shared bucket's owner did that in finish_next())."""
        self.range.commit(None if self.nodes is not None else [bool(f & _STEP) for f in flags])
        for i in range(len(flags)):
            if flags[i]:
                self.remember(i)
        self.unbind()
