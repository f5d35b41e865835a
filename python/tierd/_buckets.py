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

from . import _abi, streaming
from .client import Access

DTYPES = {torch.float32: _abi.FLOAT32, torch.bfloat16: _abi.BFLOAT16,
          torch.float16: _abi.FLOAT16}


class Bucket:
    def __init__(self, serial: int, name: str, group: Dict[str, Any],
                 params: List[torch.Tensor]):
        self.serial = serial      # creation order: the order of collectives over ranks
        self.name = name          # the tierd group's name
        self.group = group        # the param_groups entry whose hyperparameters it steps with
        self.owner = 0
        self.slot: Optional[int] = None  # the tierd group's index in this rank's state
        self.params: Optional[List[torch.Tensor]] = list(params)  # None once dormant
        self._refs: List[weakref.ref] = []
        self.sizes = [p.numel() for p in params]
        self.offsets = []
        n = 0
        for size in self.sizes:
            self.offsets.append(n)
            n += size
        self.numel = n
        self.dtype = params[0].dtype
        self.device = params[0].device
        k = len(params)
        self._buffers()
        self.live = [True] * k
        self.flags = (ctypes.c_uint8 * max(k, 1))()
        self.weights: Optional[torch.Tensor] = None  # fp32 weights to take, made when needed
        # Each weight's (version, data_ptr) when the optimizer last left it, and when the flags
        # of this step were set.
        self.seen: List[Tuple[int, int]] = [(-1, 0)] * k
        self.flagged: List[Tuple[int, int]] = [(-1, 0)] * k
        # This step's: gradients in `grad` (got), whether each was present on any rank (has),
        # the gradients backward is expected to give (expected) and has given (arrived).
        self.got = [False] * k
        self.has = [False] * k
        self.expected = 0
        self.arrived = 0
        self.complete = False     # every gradient it will get this step is taken
        self.event = None         # the side stream's copies, when the model is on a GPU
        self.launched = False     # given to the optimizer this step

    def _buffers(self) -> None:
        n, k = self.numel, len(self.sizes)
        pin = self.device.type == "cuda"
        self.grad_ext = torch.zeros(n + k, dtype=self.dtype, pin_memory=pin)
        self.out_ext = torch.zeros(n + k, dtype=self.dtype, pin_memory=pin)
        self.grad = self.grad_ext[:n]
        # The weights as the optimizer last left them in the model (what it wrote after a step,
        # or read at the start): a weight that differs was changed by the caller.
        self.out = self.out_ext[:n]

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
                self.slice(self.out, i).copy_(p.detach().reshape(-1))
                self.remember(i)

    def need_grad(self) -> None:
        """Makes `grad` writable for this step's gradients (always, here)."""

    def bind(self) -> None:
        """Makes `out` writable for this step's new weights (always, here)."""

    def publish(self, flags: List[int]) -> None:
        """The step's new weights in `out` (flags per parameter) into the model."""
        for i, values in self.slices(self.out):
            if flags[i] & _abi.ADAM_TENSOR_STEP:
                p = self.params[i]
                p.copy_(values.view_as(p), non_blocking=p.is_cuda)
            if flags[i]:
                self.remember(i)

    def unbind(self) -> None:
        """The step is over (published or not)."""

    def drop_grad(self, i: int) -> None:
        """After weight i's gradient was taken (a streamed one leaves the device)."""

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
            if self.has[i]:
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
        same = torch.equal(p.detach().reshape(-1).to("cpu"), self.slice(self.out, i))
        if same:
            self.remember(i)
        return not same

    def reset_step(self) -> None:
        k = len(self.sizes)
        self.got = [False] * k
        self.has = [False] * k
        self.arrived = 0
        self.complete = False
        self.event = None
        self.launched = False


def plan(params: List[Tuple[int, Dict[str, Any], torch.Tensor]], bucket_params: int,
         first_serial: int) -> List[Bucket]:
    """Buckets for `params` ((group index, group, parameter), in the groups' order): per group, in
    backward's order (the last parameters' gradients come first), cut at a change of dtype or
    device and at bucket_params; a streamed parameter's bucket is its unit's parameters of the
    group and dtype (streaming.py), the units' in backward's order first. Named
    "g<group index>.<serial>"."""
    buckets: List[Bucket] = []
    by_group: Dict[int, List[Tuple[Dict[str, Any], torch.Tensor]]] = {}
    for gi, group, p in params:
        by_group.setdefault(gi, []).append((group, p))
    for gi in sorted(by_group, reverse=True):
        current: List[torch.Tensor] = []
        size = 0
        group = by_group[gi][0][0]
        units: Dict[Tuple[int, int, torch.dtype], List[torch.Tensor]] = {}
        plain = []
        for _, p in by_group[gi]:
            s = streaming.stream_of(p)
            if s is None:
                plain.append((group, p))
            else:
                units.setdefault((id(s), s.unit_of(p).index, p.dtype), []).append(p)
        for key in sorted(units, key=lambda k: (k[0], -k[1], str(k[2]))):
            serial = first_serial + len(buckets)
            buckets.append(StreamBucket(serial, f"g{gi}.{serial}", group, units[key]))

        def close():
            serial = first_serial + len(buckets)
            buckets.append(Bucket(serial, f"g{gi}.{serial}", group, current))
        for _, p in reversed(plain):
            if current and (p.dtype != current[0].dtype or p.device != current[0].device
                            or size + p.numel() > bucket_params):
                close()
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            close()
    return buckets


def check_dtype(p: torch.Tensor) -> None:
    if p.dtype not in DTYPES:
        raise TypeError(f"OffloadedAdamW: a parameter of dtype {p.dtype}; float32, bfloat16 and "
                        "float16 are supported")


class StreamBucket(Bucket):
    """A bucket of streamed parameters (streaming.py): a range of their unit's chunks. Its
    gradients are a daemon chunk; the step's new weights go into the range's other version,
    current from publish() on; the weights as the model has them are the current version."""

    def __init__(self, serial: int, name: str, group: Dict[str, Any],
                 params: List[torch.Tensor]):
        self.stream = streaming.stream_of(params[0])
        super().__init__(serial, name, group, params)
        self.held = None  # the other version, held for this step's new weights
        self.grad_held = None  # the gradient chunk, held during a step

    def place(self):
        """(unit, range): looked up each time, as arrange() makes new ranges."""
        if self.stream.closed:
            raise RuntimeError("OffloadedAdamW: the parameter stream of these parameters was "
                               "closed (close the optimizer first)")
        return self.stream.range_of(self.params)

    def _buffers(self) -> None:
        self.out_ext = self.out = None
        self.grad_ext = self.grad = None

    def attach(self) -> None:
        """After the stream laid this bucket out as a range: its gradient chunk."""
        u, r = self.place()
        self.stream.grad_chunk(u, r)

    def need_grad(self) -> None:
        """Holds the gradient chunk from the step's first gradient to its end."""
        if self.grad is None:
            u, r = self.place()
            self.grad_ext, self.grad_held = self.stream.hold_grad(u, r)
            self.grad = self.grad_ext[:self.numel]

    def _current(self, i: Optional[int] = None) -> torch.Tensor:
        """A copy of the current version's weights: all of them, or weight i's alone."""
        u, r = self.place()
        view, held = self.stream.hold_range(u, r, r.current, Access.READ)
        flat = (view[:self.numel] if i is None else self.slice(view, i)).clone()
        del view
        held.__exit__(None, None, None)
        return flat

    def weight(self, i: int) -> torch.Tensor:
        return self._current(i)

    def set_weights(self, flat: torch.Tensor) -> None:
        u, r = self.place()
        view, held = self.stream.hold_range(u, r, r.current, Access.WRITE)
        view[:self.numel].copy_(flat.reshape(-1))
        del view
        held.__exit__(None, None, None)

    def mirror(self) -> None:
        if self.params is not None:
            for p in self.params:
                self.stream.clear_edited(p)

    def remember(self, i: int) -> None:
        self.stream.clear_edited(self.param(i))

    def touched(self, i: int) -> bool:
        return self.stream.edited(self.param(i))

    def written_since_flagged(self) -> bool:
        return False  # its weights change only in the stream's gathered(), refused in a step

    def changed(self, i: int) -> bool:
        return self.touched(i)

    def bind(self) -> None:
        if self.held is None:
            u, r = self.place()
            view, self.held = self.stream.hold_range(u, r, 1 - r.current, Access.OVERWRITE)
            self.out_ext = view
            self.out = view[:self.numel]

    def publish(self, flags: List[int]) -> None:
        """The other version becomes current: the new weights where stepped, the current ones
        copied across elsewhere."""
        u, r = self.place()
        if any(not f & _abi.ADAM_TENSOR_STEP for f in flags):
            now = self._current()
            for i, values in self.slices(self.out):
                if not flags[i] & _abi.ADAM_TENSOR_STEP:
                    values.copy_(self.slice(now, i))
        r.current = 1 - r.current
        self.stream.stepped(u)
        for i in range(len(flags)):
            if flags[i]:
                self.remember(i)
        self.unbind()

    def unbind(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            self.out_ext = self.out = None
            held.__exit__(None, None, None)
        if self.grad is not None:
            held, self.grad_held = self.grad_held, None
            self.grad_ext = self.grad = None
            held.__exit__(None, None, None)

    def drop_grad(self, i: int) -> None:
        p = self.params[i]
        self.stream.note_d2h(p.numel() * p.element_size())
        p.grad = None
