"""Parameter streaming: a model whose weights do not fit on the device trains through a window.

    stream = tierd.torch.stream_parameters(model, device=torch.device("cuda"),
                                           device_budget_bytes=8 << 30)
    opt = tierd.torch.OffloadedAdamW(model.parameters(), lr=3e-4, overlap_backward=True)
    for x, y in data:
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

The model is cut into *units* (module subtrees; by default the blocks of its largest ModuleList).
Each unit's weights live in two daemon chunks, the unit's two *versions* (at home in the host tier
up to host_budget_bytes, on NVMe past it); on the device a unit's parameters keep their shape but
have an empty storage, except while the unit is in the *window*: fetched for its forward, again
for its backward, released after each. Everything outside the units stays on the device.

A unit's device memory is one storage per dtype, which its parameters view: fetching resizes it
and copies the weights in (on a side stream on a GPU, on a copy thread on the CPU), releasing
resizes it to nothing. Tensors autograd saved in forward that view a parameter (a weight's
transpose) view that same storage, so backward reads the weights fetched for it.

Hooks (no wrapper class): a forward pre-hook fetches the unit (waiting for its copy) and starts
the copies of the next `prefetch` units in the order the first iteration traced; a forward
post-hook releases it and hooks its outputs, whose gradients arriving mean its backward is next
(fetch again, prefetch in backward's order); an identity autograd Function on its inputs runs
when its backward is done (release, with any recompute whose forward a checkpoint stopped early),
and an end-of-backward callback releases what had none. Counts make a module called twice, or
recomputed by activation checkpointing, fetch once.

OffloadedAdamW steps streamed parameters in one bucket per unit and parameter group (a *range* of
the unit's chunks): gradients leave the device as autograd finishes each one, and the kernel
writes the new weights into the range's other version, which the step's end makes current; a
step rolled back or skipped leaves the current version as it was.
"""
import concurrent.futures
import threading
import time
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.utils.dlpack

from .client import Access, Client, Tier, TierdError, connect

__all__ = ["ParameterStream", "stream_parameters"]

_ALIGN = 256  # bytes: each range starts at a multiple in its chunk
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what OffloadedAdamW steps
_DL_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Every streamed parameter (by id) -> (stream, unit): how OffloadedAdamW finds them.
_STREAMED: "weakref.WeakValueDictionary[int, ParameterStream]" = weakref.WeakValueDictionary()


def stream_of(p: torch.Tensor) -> Optional["ParameterStream"]:
    """The open stream that streams parameter p, if any."""
    s = _STREAMED.get(id(p))
    if s is None or s.closed or id(p) not in s._unit_of:
        return None
    return s


def _storage(t: torch.Tensor):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def _resize(t: torch.Tensor, elements: int) -> None:
    """Gives flat tensor t's storage room for `elements` (0: frees it); t's views see it."""
    st = _storage(t)
    if hasattr(t, "untyped_storage"):
        st.resize_(elements * t.element_size())
    else:
        st.resize_(elements)


def _storage_empty(t: torch.Tensor) -> bool:
    st = _storage(t)
    return (st.nbytes() if hasattr(st, "nbytes") else st.size() * t.element_size()) == 0


def grad_accumulator(p: torch.Tensor):
    """p's AccumulateGrad node (the hook point for its gradient on torch < 2.1). A streamed
    parameter outside the window has no storage for the view that finds it: it gets room for a
    moment (no copy, no read)."""
    if not _storage_empty(p) or p.numel() == 0:
        return p.expand_as(p).grad_fn.next_functions[0][0]
    _resize(p, p.storage_offset() + p.numel())
    try:
        return p.expand_as(p).grad_fn.next_functions[0][0]
    finally:
        _resize(p, 0)


class _Range:
    """Parameters of one dtype of a unit laid end to end in its chunks (and, on the device, in the
    unit's storage of that dtype): the optimizer steps one range as one bucket. `extra` elements
    follow the values in the chunks (the sharded optimizer's per-parameter flags)."""

    def __init__(self, params: List[torch.Tensor], extra: int):
        self.params = params
        self.dtype = params[0].dtype
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.extra = extra
        self.offset = 0         # bytes, in each version's chunk
        self.device_offset = 0  # elements, in the unit's device storage of its dtype
        self.current = 0        # the version holding the weights
        self.grad_chunk = None  # the optimizer's gradients (grad_chunk)

    @property
    def nbytes(self) -> int:
        return (self.numel + self.extra) * self.params[0].element_size()


class _Unit:
    def __init__(self, index: int, name: str, module: nn.Module, params: List[torch.Tensor]):
        self.index = index
        self.name = name
        self.module = module
        self.params = params
        self.ranges: List[_Range] = []
        self.flat: Dict[torch.dtype, torch.Tensor] = {}  # device storage per dtype
        self.chunks = None          # ChunkSet: version 0, version 1
        self.chunk_bytes = 0
        self.home = Tier.HOST
        self.held = None            # a host unit's acquisition of both versions, kept
        self.views: Dict[int, torch.Tensor] = {}  # version -> uint8 view of a held chunk
        self.refs = 0               # forward and backward passes using it now
        self.bwd_refs = 0           # of them, backward passes its inputs' gradients end
        self.recompute_refs = 0     # of them, recomputes in its backward (which may stop early)
        self.host_asked = False     # an NVMe unit's chunks asked into host memory
        self.copy = None            # the fetch in flight: a Future, or a CUDA event
        self.reading = None         # an NVMe unit's acquisition the copy reads from
        self.materialized = False
        self.edited = set()         # ids of parameters whose weights gathered() changed

    @property
    def device_bytes(self) -> int:
        return sum(r.numel * r.params[0].element_size() for r in self.ranges)


class ParameterStream:
    """The hooks and the chunks of stream_parameters(); see the module's text."""

    def __init__(self, model: nn.Module, units: Optional[Sequence[nn.Module]] = None,
                 device: Optional[torch.device] = None, device_budget_bytes: int = 8 << 30,
                 prefetch: int = 1, host_budget_bytes: Optional[int] = None,
                 name: Optional[str] = None, client: Optional[Client] = None,
                 socket_dir: Optional[str] = None, poison: bool = False):
        device = torch.device(device if device is not None else "cuda")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, not {prefetch}")
        if host_budget_bytes is not None and host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0, not {host_budget_bytes}")
        self.closed = True  # until set up: close() and __del__ read it
        self.model = model
        self.device = device
        self.device_budget_bytes = int(device_budget_bytes)
        self.prefetch = int(prefetch)
        self.window = self.prefetch + 2
        self.host_budget_bytes = host_budget_bytes
        self.name = name or type(model).__name__
        self.poison = poison
        self._lock = threading.RLock()
        self._units: List[_Unit] = self._find_units(model, units)
        self._unit_of: Dict[int, _Unit] = {}
        for u in self._units:
            for p in u.params:
                self._unit_of[id(p)] = u
        self._resident = self._resident_tensors()
        self._check_budget()

        self._own_client = client is None
        self._client = client if client is not None else connect(socket_dir, f"stream {self.name}")
        self._cuda = device.type == "cuda"
        self._side = None
        self._pool = None
        if self._cuda:
            self._client.cuda_device()  # the daemon's host memory page-locked: copies are DMA
            self._side = torch.cuda.Stream(device)
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierd-copy")
        has_nvme = self._client.tier_usage(Tier.NVME).configured
        self._stats = dict(fetches=0, on_demand=0, trace_misses=0, h2d_bytes=0, d2h_bytes=0,
                           wait_s=0.0, iterations=0, over_window=0, schedules=0)
        self._nvme_start = self._client.path_bytes("nvme_to_host")
        self._live = 0
        self._peak = 0
        self._hooks: List[Any] = []
        # The order units were fetched in over the first iteration (forward, recompute,
        # backward), and where this iteration is in it.
        self._trace: Optional[List[int]] = None
        self._recording: List[int] = []
        self._pos = 0
        self._in_backward = False
        self._callback_queued = False
        self._gathering = False  # inside gathered(): the hooks stand aside
        self._declared = False   # the trace is the daemon's schedule
        self._stale = False      # versions changed since it was declared
        self._cursor_base = 0
        try:
            self._place(has_nvme)
            self._move_resident()
            self.closed = False
            for u in self._units:
                self._lay_out(u, [[p for p in u.params if p.dtype == d] for d in _DTYPES], 1)
                self._adopt(u)
            for u in self._units:
                for p in u.params:
                    _STREAMED[id(p)] = self
            self._install()
        except BaseException:
            self.close()
            raise

    # ---- the units ----

    @staticmethod
    def _find_units(model: nn.Module, given: Optional[Sequence[nn.Module]]) -> List[_Unit]:
        names = {id(m): n for n, m in model.named_modules()}
        if given is None:
            best, best_params = None, 0
            for m in model.modules():
                if not isinstance(m, nn.ModuleList) or len(m) < 2:
                    continue
                if len({type(c) for c in m}) != 1:
                    continue  # like blocks only
                n = sum(p.numel() for p in m.parameters())
                if n > best_params:
                    best, best_params = m, n
            if best is None:
                raise ValueError("stream_parameters: the model has no nn.ModuleList of like "
                                 "blocks with parameters: name the units (units=[...])")
            given = list(best)
        modules = list(given)
        if not modules:
            raise ValueError("stream_parameters: no units")
        for m in modules:
            if id(m) not in names:
                raise ValueError(f"stream_parameters: a unit ({type(m).__name__}) is not a "
                                 "module of the model")
        ids = {id(m) for m in modules}
        for m in modules:
            for sub in m.modules():
                if sub is not m and id(sub) in ids:
                    raise ValueError(f"stream_parameters: unit {names[id(sub)]!r} is inside "
                                     f"unit {names[id(m)]!r}")
        owner: Dict[int, str] = {}
        units = []
        for i, m in enumerate(modules):
            params = []
            for p in m.parameters():  # each once, shared within the unit or not
                if id(p) in owner:
                    raise ValueError(f"stream_parameters: a parameter of shape {tuple(p.shape)} "
                                     f"is in two units ({owner[id(p)]!r} and "
                                     f"{names[id(m)]!r}): make it one unit, or keep it out "
                                     "of the units")
                owner[id(p)] = names[id(m)]
                params.append(p)
            units.append(_Unit(i, names[id(m)], m, params))
        # Parameters also reached from outside the units (tied, e.g. an embedding and the head)
        # stay resident.
        unit_modules = {id(sub) for u in units for sub in u.module.modules()}
        outside = set()
        for m in model.modules():
            if id(m) in unit_modules:
                continue
            for p in m.parameters(recurse=False):
                outside.add(id(p))
        for u in units:
            u.params = [p for p in u.params if id(p) not in outside]
            for p in u.params:
                if p.dtype not in _DTYPES:
                    raise TypeError(f"stream_parameters: parameter of unit {u.name!r} is "
                                    f"{p.dtype}; OffloadedAdamW steps float32, bfloat16 and "
                                    "float16")
        return [u for u in units if u.params]

    def _resident_tensors(self) -> List[torch.Tensor]:
        streamed = self._unit_of
        seen, out = set(), []
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if id(t) not in streamed and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    def _check_budget(self) -> None:
        resident = sum(t.numel() * t.element_size() for t in self._resident)
        largest = max(sum(p.numel() * p.element_size() for p in u.params) for u in self._units)
        need = resident + self.window * largest + largest  # the window, and one unit's grads
        self.resident_bytes = resident
        self.largest_unit_bytes = largest
        if self.device_budget_bytes < need:
            raise ValueError(
                f"stream_parameters: a device budget of {self.device_budget_bytes:,} bytes is "
                f"below the {need:,} needed: {resident:,} resident + ({self.prefetch} prefetch + "
                f"2) x {largest:,} (the largest unit) + {largest:,} (its gradients)")

    def _place(self, has_nvme: bool) -> None:
        """Each unit's chunks (two versions), at home on the host up to the budget."""
        host_left = self.host_budget_bytes
        for u in self._units:
            u.chunk_bytes = sum(_align(p.numel() * p.element_size() + p.element_size())
                                for p in u.params) + _ALIGN * len(_DTYPES)
            size = 2 * u.chunk_bytes
            if host_left is None or size <= host_left or not has_nvme:
                u.home = Tier.HOST
                if host_left is not None:
                    host_left -= min(size, host_left)
            else:
                u.home = Tier.NVME
            u.chunks = self._client.allocate([u.chunk_bytes, u.chunk_bytes], u.home)
            if u.home == Tier.HOST:
                u.held = self._client.acquire(u.chunks, Tier.HOST, Access.WRITE)
                for v in (0, 1):
                    u.views[v] = torch.utils.dlpack.from_dlpack(
                        u.held.dlpack(v, "uint8", [u.chunk_bytes]))

    def _move_resident(self) -> None:
        with torch.no_grad():
            for t in self._resident:
                if t.device != self.device:
                    t.data = t.data.to(self.device)
        self._live = sum(t.numel() * t.element_size() for t in self._resident)
        self._peak = self._live

    def _lay_out(self, u: _Unit, groups: List[List[torch.Tensor]], extra_per_param: int) -> None:
        """Sets u's ranges (one per list of parameters, each of one dtype) and their places."""
        ranges = [_Range(g, extra_per_param * len(g)) for g in groups if g]
        offset = 0
        device_offsets: Dict[torch.dtype, int] = {}
        for r in ranges:
            r.offset = offset
            offset += _align(r.nbytes)
            r.device_offset = device_offsets.get(r.dtype, 0)
            device_offsets[r.dtype] = r.device_offset + r.numel
        if offset > u.chunk_bytes:
            raise ValueError(f"stream_parameters: unit {u.name!r} needs {offset} bytes of chunk "
                             f"for this layout, it has {u.chunk_bytes}")
        u.ranges = ranges
        u.flat = {d: torch.empty(n, dtype=d, device=self.device)
                  for d, n in device_offsets.items()}
        for f in u.flat.values():
            _resize(f, 0)

    def _adopt(self, u: _Unit) -> None:
        """Copies the unit's weights (wherever the model has them) into version 0 and points its
        parameters at the unit's empty device storage."""
        with self._holding(u, 0, Access.OVERWRITE) as view:
            for r in u.ranges:
                r.current = 0
                values = self._range_view(view, r)
                for i, p in enumerate(r.params):
                    values[_off(r, i):_off(r, i) + r.sizes[i]].copy_(p.detach().reshape(-1))
        self._point(u)

    def _point(self, u: _Unit) -> None:
        """Points u's parameters at their places in its device storage (made with room for a
        moment: a view of an empty storage cannot be taken)."""
        if not u.materialized:
            for f in u.flat.values():
                _resize(f, f.numel())
        with torch.no_grad():
            for r in u.ranges:
                flat = u.flat[r.dtype]
                for i, p in enumerate(r.params):
                    start = r.device_offset + _off(r, i)
                    p.data = flat[start:start + r.sizes[i]].view(p.shape)
        if not u.materialized:
            for f in u.flat.values():
                _resize(f, 0)

    def _range_view(self, view: torch.Tensor, r: _Range) -> torch.Tensor:
        """Range r's elements (values, then extras) in a uint8 view of a whole chunk."""
        return view[r.offset:r.offset + r.nbytes].view(r.dtype)

    class _Held:
        def __init__(self, stream, u, version, access):
            self.stream, self.u, self.version, self.access = stream, u, version, access
            self.acq = None

        def __enter__(self):
            u = self.u
            if u.home == Tier.HOST:
                return u.views[self.version]
            c = self.stream._client
            self.acq = c.acquire([u.chunks.ids[self.version]], Tier.HOST, self.access)
            return torch.utils.dlpack.from_dlpack(self.acq.dlpack(0, "uint8", [u.chunk_bytes]))

        def __exit__(self, *exc):
            if self.acq is not None:
                self.acq.__exit__(*exc)  # released once the views made here are gone

    def _holding(self, u: _Unit, version: int, access: Access) -> "_Held":
        """A uint8 CPU view of version `version` of u's chunk, held for the with block."""
        return ParameterStream._Held(self, u, version, access)

    # ---- hooks ----

    def _install(self) -> None:
        for u in self._units:
            self._hooks.append(u.module.register_forward_pre_hook(
                lambda m, args, u=u: self._pre_forward(u, args)))
            self._hooks.append(u.module.register_forward_hook(
                lambda m, args, out, u=u: self._post_forward(u, out)))

    def _pre_forward(self, u: _Unit, args):
        self._check_open()
        if self._gathering:
            return None  # the weights are in place on the CPU: a forward just reads them
        # A forward of a unit in backward is its recompute (a checkpoint around it), once its
        # backward has begun; any other forward while "in backward" means the last backward
        # raised before its end.
        recompute = self._in_backward and u.bwd_refs > 0
        if self._in_backward and not recompute:
            self._recover()
        self._use(u, traced=recompute or torch.is_grad_enabled())
        if recompute:
            u.recompute_refs += 1
        if recompute or not torch.is_grad_enabled():
            return None
        tensors = [a for a in args if torch.is_tensor(a) and a.requires_grad]
        if not tensors:
            return None
        marked = _AfterBackward.apply(_Token(self, u), *tensors)
        marked = list(marked) if len(tensors) > 1 else [marked]
        out = []
        for a in args:
            if torch.is_tensor(a) and a.requires_grad:
                out.append(marked.pop(0))
            else:
                out.append(a)
        return tuple(out)

    def _post_forward(self, u: _Unit, output):
        if self._gathering:
            return None
        if not self._in_backward and torch.is_grad_enabled():
            fired = [False]

            def before_backward(grad, u=u, fired=fired):
                if not fired[0]:
                    fired[0] = True
                    self._before_backward(u)
                return grad
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(before_backward)
        if self._in_backward and u.recompute_refs > 0:
            u.recompute_refs -= 1
        self._unuse(u)
        return None

    def _before_backward(self, u: _Unit) -> None:
        if not self._in_backward:
            self._in_backward = True
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._use(u, traced=True)
        u.bwd_refs += 1

    def _after_backward(self, u: _Unit) -> None:
        if u.bwd_refs > 0:
            u.bwd_refs -= 1
            self._unuse(u)
        self._end_recomputes(u)

    def _end_recomputes(self, u: _Unit) -> None:
        """Releases u's recomputes whose forward never ended: torch 2's non-reentrant checkpoint
        stops a recompute once it has what backward needs, before the module's forward hook."""
        while u.recompute_refs > 0:
            u.recompute_refs -= 1
            self._unuse(u)

    def _end_backward(self) -> None:
        """After every backward: releases what no input's gradient released (a unit whose
        inputs need none), ends the traced iteration."""
        with self._lock:
            for u in self._units:
                while u.bwd_refs > 0:
                    u.bwd_refs -= 1
                    self._unuse(u)
                self._end_recomputes(u)
            for u in self._units:
                if u.refs == 0 and u.materialized:
                    self._release(u)
            self._in_backward = False
            self._callback_queued = False
            self._end_iteration()

    def _recover(self) -> None:
        """After a backward that raised: nothing it fetched stays, its iteration is not traced."""
        with self._lock:
            for x in self._units:
                x.refs = 0
                x.bwd_refs = 0
                x.recompute_refs = 0
                self._release(x)
            self._in_backward = False
            self._callback_queued = False
            self._recording = []
            self._pos = 0

    def _end_iteration(self) -> None:
        self._stats["iterations"] += 1
        if self._trace is None and self._recording:
            self._trace = self._recording
            self._declare()
        elif self._declared:
            self._cursor_base += len(self._trace)
        self._recording = []
        self._pos = 0

    def _declare(self) -> None:
        """The trace as the daemon's schedule, so that its planner brings NVMe-homed units into
        host memory before their turn: step k of an iteration reads the current versions of the
        k-th unit the trace names (a host-homed unit's step reads nothing: it stays held). Made
        again after a step changes versions; the hooks announce each step."""
        self._stale = False
        if not any(u.home == Tier.NVME for u in self._units):
            return
        steps = []
        for index in self._trace:
            u = self._units[index]
            ids = sorted({u.chunks.ids[r.current] for r in u.ranges}) if u.home == Tier.NVME \
                else []
            steps.append([(i, Tier.HOST, Access.READ) for i in ids])
        self._client.set_schedule(steps)
        self._declared = True
        self._cursor_base = 0
        self._stats["schedules"] += 1

    # ---- the window ----

    def _use(self, u: _Unit, traced: bool) -> None:
        """u is needed now (`traced`: by training's forward, recompute or backward, which the
        trace follows; not by a forward without gradients)."""
        with self._lock:
            if traced:
                self._follow(u)
            if u.refs == 0 and not u.materialized:
                self._stats["on_demand"] += 1
            u.refs += 1
            self._fetch(u)
            self._wait(u)
            self._prefetch_next()

    def _unuse(self, u: _Unit) -> None:
        with self._lock:
            u.refs -= 1
            if u.refs == 0 and not self._needed_soon(u):
                self._release(u)

    def _needed_soon(self, u: _Unit) -> bool:
        """Whether u is among the next units the trace names (the last block of forward is the
        first of backward): kept in the window as a prefetch."""
        for k, nxt in enumerate(self._upcoming()):
            if k >= max(self.prefetch, 1):
                return False
            if nxt is u:
                return True
        return False

    def _follow(self, u: _Unit) -> None:
        """Moves this iteration's place in the trace to u's use (a miss when it is not next)."""
        self._recording.append(u.index)
        trace = self._trace
        if trace is None:
            return
        if len(self._recording) == 1 and self._stale:  # an iteration starts after a step
            self._declare()
        at = None
        if self._pos < len(trace) and trace[self._pos] == u.index:
            at = self._pos
        else:
            self._stats["trace_misses"] += 1
            for k in range(self._pos, len(trace)):
                if trace[k] == u.index:
                    at = k
                    break
        if at is None:
            self._pos = len(trace)  # off the trace: on demand until the iteration ends
            return
        self._pos = at + 1
        if self._declared:
            self._client.begin_step(self._cursor_base + at)

    def _upcoming(self) -> Iterator[_Unit]:
        """The units the trace says come next (before the first trace: forward's order, then
        backward's)."""
        if self._trace is not None:
            for k in range(self._pos, len(self._trace)):
                yield self._units[self._trace[k]]
            return
        last = self._recording[-1] if self._recording else -1
        if not self._in_backward:
            for i in range(last + 1, len(self._units)):
                yield self._units[i]
        for i in range(last - 1 if self._in_backward else len(self._units) - 1, -1, -1):
            yield self._units[i]

    def _prefetch_next(self) -> None:
        wanted = []
        for nxt in self._upcoming():
            if len(wanted) >= self.prefetch:
                break
            if nxt not in wanted:
                wanted.append(nxt)
        for nxt in wanted:
            if nxt.materialized:
                continue
            if self._in_window() >= self.window:
                break
            self._fetch(nxt)
        if self._declared and self._pos < len(self._trace):
            return  # the daemon's planner brings NVMe units up, following the schedule
        # NVMe units further on: brought into host memory by the daemon meanwhile.
        ahead = []
        for nxt in self._upcoming():
            if len(ahead) >= self.window:
                break
            if nxt.home == Tier.NVME and not nxt.materialized and nxt not in ahead:
                ahead.append(nxt)
        ahead = [x for x in ahead if not x.host_asked]
        if ahead:
            ids = sorted({x.chunks.ids[r.current] for x in ahead for r in x.ranges})
            self._client.prefetch(ids, Tier.HOST)
            for x in ahead:
                x.host_asked = True

    def _in_window(self) -> int:
        return sum(1 for x in self._units if x.materialized)

    def _fetch(self, u: _Unit) -> None:
        """Starts copying u's current weights into its device storage (nothing if there)."""
        if u.materialized:
            return
        while self._in_window() >= self.window:  # a prefetch not asked for gives way
            idle = [x for x in self._units if x.materialized and x.refs == 0 and x is not u]
            if not idle:
                self._stats["over_window"] += 1
                break
            self._release(idle[0])
        for f in u.flat.values():
            _resize(f, f.numel())
            if self.poison:
                f.fill_(float("nan"))
        u.materialized = True
        u.host_asked = False
        self._live += u.device_bytes
        self._peak = max(self._peak, self._live)
        self._stats["fetches"] += 1
        self._stats["h2d_bytes"] += u.device_bytes
        if u.home == Tier.NVME:
            versions = sorted({r.current for r in u.ranges})
            u.reading = self._client.acquire([u.chunks.ids[v] for v in versions], Tier.HOST,
                                             Access.READ)
            views = {v: torch.utils.dlpack.from_dlpack(u.reading.dlpack(k, "uint8",
                                                                        [u.chunk_bytes]))
                     for k, v in enumerate(versions)}
        else:
            views = u.views
        pairs = []
        for r in u.ranges:
            src = self._range_view(views[r.current], r)[:r.numel]
            dst = u.flat[r.dtype][r.device_offset:r.device_offset + r.numel]
            pairs.append((dst, src))
        if self._cuda:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                u.copy = torch.cuda.Event()
                u.copy.record(self._side)
        else:
            delay = self.poison

            def copy(pairs=pairs):
                if delay:
                    time.sleep(0.002)  # a late copy: a read before it sees NaN
                for dst, src in pairs:
                    dst.copy_(src)
            u.copy = self._pool.submit(copy)

    def _wait(self, u: _Unit) -> None:
        """Makes compute wait for u's copy (on a GPU the stream waits, not the host)."""
        if u.copy is None:
            return
        started = time.perf_counter()
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(u.copy)
            if u.reading is not None:  # the host copy is read: release it once done
                u.copy.synchronize()
        else:
            u.copy.result()
        u.copy = None
        if u.reading is not None:
            u.reading.__exit__(None, None, None)  # released once the copy's views are gone
            u.reading = None
        self._stats["wait_s"] += time.perf_counter() - started

    def _release(self, u: _Unit) -> None:
        if not u.materialized:
            return
        if u.copy is not None:  # a prefetch never used: let its copy end first
            self._wait(u)
        for f in u.flat.values():
            if self.poison:
                f.fill_(float("nan"))
            _resize(f, 0)
        u.materialized = False
        self._live -= u.device_bytes

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("stream_parameters: the stream was closed")

    # ---- for OffloadedAdamW ----

    def unit_of(self, p: torch.Tensor) -> _Unit:
        return self._unit_of[id(p)]

    def arrange(self, layout: Dict[int, List[List[torch.Tensor]]], extra_per_param: int) -> None:
        """Lays each unit (index -> its parameters, one list per range) out anew, moving the
        current weights: the optimizer's buckets become the ranges. Between steps."""
        with self._lock:
            for index, groups in layout.items():
                u = self._units[index]
                if u.materialized or u.refs:
                    raise RuntimeError("stream_parameters: units are rearranged between steps")
                values = {id(p): w for p, w in self._weights(u)}
                self._drop_grads(u)
                self._lay_out(u, groups, extra_per_param)
                with self._holding(u, 0, Access.OVERWRITE) as view:
                    for r in u.ranges:
                        r.current = 0
                        dst = self._range_view(view, r)
                        for i, p in enumerate(r.params):
                            dst[_off(r, i):_off(r, i) + r.sizes[i]].copy_(values[id(p)])
                self._point(u)

    def _weights(self, u: _Unit) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Every parameter of u with a copy of its current weights (flat, on the CPU)."""
        out = []
        for v in (0, 1):
            rs = [r for r in u.ranges if r.current == v]
            if not rs:
                continue
            with self._holding(u, v, Access.READ) as view:
                for r in rs:
                    values = self._range_view(view, r)
                    for i, p in enumerate(r.params):
                        out.append((p, values[_off(r, i):_off(r, i) + r.sizes[i]].clone()))
        return out

    def range_of(self, params: List[torch.Tensor]) -> Tuple[_Unit, _Range]:
        u = self._unit_of[id(params[0])]
        for r in u.ranges:
            if len(r.params) == len(params) and all(a is b for a, b in zip(r.params, params)):
                return u, r
        raise RuntimeError("stream_parameters: no range holds these parameters")

    def hold_range(self, u: _Unit, r: _Range, version: int, access: Access):
        """(a flat view of range r's elements in `version`, its holder to exit when done)."""
        held = self._holding(u, version, access)
        view = held.__enter__()
        return self._range_view(view, r), held

    def grad_chunk(self, u: _Unit, r: _Range) -> None:
        """Range r's gradient chunk (its values and extras, of its dtype): a scratch chunk at
        home in the host tier, held only during a step (hold_grad)."""
        if r.grad_chunk is None:
            r.grad_chunk = self._client.allocate([max(r.nbytes, 1)], Tier.HOST)

    def hold_grad(self, u: _Unit, r: _Range):
        """(a view of range r's gradient chunk, its acquisition to exit when done)."""
        self.grad_chunk(u, r)
        held = self._client.acquire(r.grad_chunk, Tier.HOST, Access.OVERWRITE)
        view = torch.utils.dlpack.from_dlpack(
            held.dlpack(0, _DL_NAMES[r.dtype], [r.numel + r.extra]))
        return view, held

    def _drop_grads(self, u: _Unit) -> None:
        for r in u.ranges:
            if r.grad_chunk is not None:
                chunks, r.grad_chunk = r.grad_chunk, None
                chunks.__exit__(None, None, None)

    def stepped(self, u: _Unit) -> None:
        """A range of u has new weights: a copy of the old ones in the window goes."""
        with self._lock:
            self._stale = True
            if u.refs == 0:
                self._release(u)

    def note_d2h(self, nbytes: int) -> None:
        self._stats["d2h_bytes"] += nbytes

    def edited(self, p: torch.Tensor) -> bool:
        return id(p) in self._unit_of[id(p)].edited

    def clear_edited(self, p: torch.Tensor) -> None:
        self._unit_of[id(p)].edited.discard(id(p))

    # ---- the user's ----

    @property
    def stats(self) -> Dict[str, float]:
        """Figures since the stream was made: device_peak_bytes (resident + units in the window),
        h2d_bytes (weights fetched), d2h_bytes (gradients sent off), nvme_read_bytes (NVMe to
        host, the whole node), wait_s (compute waiting for weights), trace_misses, on_demand
        (units not prefetched when asked for), fetches, iterations, over_window."""
        s = dict(self._stats)
        s["device_peak_bytes"] = self._peak
        s["units_on_nvme"] = sum(1 for u in self._units if u.home == Tier.NVME)
        s["device_live_bytes"] = self._live
        if self._client is not None and not self._client.closed:
            s["nvme_read_bytes"] = self._client.path_bytes("nvme_to_host") - self._nvme_start
            session = self._client.stats()
            s["planner_fetches"] = session.planner_fetches
            s["acquired_waited"] = session.acquired_waited
        return s

    @property
    def units(self) -> List[str]:
        return [u.name for u in self._units]

    def gathered(self):
        """A context in which every streamed parameter holds its weights on the CPU (the model's
        state_dict, torch.save, edits; a forward inside runs on those weights, the hooks standing
        aside); weights changed inside are kept (and OffloadedAdamW takes them as its master
        weights at its next step). To evaluate on the device, run the forward outside it, under
        torch.no_grad(): it streams as training does."""
        return _Gathered(self)

    def close(self) -> None:
        """Removes the hooks, gives every streamed parameter its weights back as a CPU tensor
        and frees the chunks."""
        if self.closed:
            if getattr(self, "_own_client", False) and getattr(self, "_client", None):
                self._client.close()
                self._client = None
            return
        for h in self._hooks:
            h.remove()
        self._hooks = []
        lost = None
        try:
            for u in self._units:
                self._release(u)
                try:
                    weights = self._weights(u) if u.chunks is not None else []
                except TierdError as e:  # the daemon is gone: so are the weights
                    lost, weights = e, []
                with torch.no_grad():
                    for p, w in weights:
                        p.data = w.view(p.shape)
                u.views = {}
                try:  # a dead daemon's chunks are gone with it
                    self._drop_grads(u)
                    if u.held is not None:
                        u.held.__exit__(None, None, None)
                    if u.chunks is not None:
                        u.chunks.__exit__(None, None, None)
                except TierdError as e:
                    lost = lost or e
                u.held = u.chunks = None
        finally:
            self.closed = True
            if self._pool is not None:
                self._pool.shutdown()
            if self._own_client and self._client is not None:
                self._client.close()
                self._client = None
        if lost is not None:
            warnings.warn(f"stream_parameters: the streamed weights could not be read back "
                          f"({lost}); the streamed parameters stay without storage",
                          RuntimeWarning, stacklevel=2)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"ParameterStream({len(self._units)} units, window {self.window}, device "
                f"{self.device}, budget {self.device_budget_bytes:,} bytes)")


class _Gathered:
    def __init__(self, stream: ParameterStream):
        self.stream = stream
        self.before: List[Tuple[_Unit, List[Tuple[torch.Tensor, torch.Tensor]]]] = []

    def __enter__(self):
        s = self.stream
        s._check_open()
        if s._in_backward or any(u.refs for u in s._units) or s._gathering:
            raise RuntimeError("stream_parameters: gathered() during a forward or backward, or "
                               "inside another gathered()")
        for u in s._units:
            s._release(u)
            weights = s._weights(u)
            self.before.append((u, weights))
            with torch.no_grad():
                for p, w in weights:
                    p.data = w.clone().view(p.shape)
        s._gathering = True
        return s

    def __exit__(self, *exc):
        s = self.stream
        s._gathering = False
        for u, weights in self.before:
            changed = {}
            for p, w in weights:
                now = p.detach().reshape(-1)
                if now.dtype != w.dtype or now.numel() != w.numel():
                    raise RuntimeError("stream_parameters: a streamed parameter's dtype or "
                                       "shape changed inside gathered()")
                if not torch.equal(now, w):
                    changed[id(p)] = now.clone()
            if changed:
                for r in u.ranges:
                    if not any(id(p) in changed for p in r.params):
                        continue
                    view, held = s.hold_range(u, r, r.current, Access.WRITE)
                    try:
                        for i, p in enumerate(r.params):
                            if id(p) in changed:
                                view[_off(r, i):_off(r, i) + r.sizes[i]].copy_(changed[id(p)])
                    finally:
                        del view
                        held.__exit__(None, None, None)
                u.edited |= set(changed)
            s._point(u)
        self.before = []


def _off(r: _Range, i: int) -> int:
    return sum(r.sizes[:i])


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _tensors(output) -> Iterator[torch.Tensor]:
    if torch.is_tensor(output):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from _tensors(o)


class _Token:
    """What the identity Function carries: the unit whose inputs it marks."""

    def __init__(self, stream: ParameterStream, unit: _Unit):
        self.stream = stream
        self.unit = unit


class _AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs: its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, token, *tensors):
        ctx.token = token
        out = tuple(t.view_as(t) for t in tensors)
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.token.stream._after_backward(ctx.token.unit)
        return (None,) + grads


def stream_parameters(model: nn.Module, units: Optional[Sequence[nn.Module]] = None,
                      device: Optional[torch.device] = None,
                      device_budget_bytes: int = 8 << 30, prefetch: int = 1,
                      host_budget_bytes: Optional[int] = None, name: Optional[str] = None,
                      **kwargs) -> ParameterStream:
    """Streams the model's units' weights through a device window (see the module's text).

    units: module subtrees fetched, released and stepped together (default: the blocks of the
        model's largest nn.ModuleList of like blocks); parameters outside them, or also used
        outside them (tied), stay resident on the device.
    device: the compute device (torch.device("cpu") with a budget is an emulated GPU).
    device_budget_bytes: at least resident + (prefetch + 2) x the largest unit + its gradients.
    prefetch: units copied ahead of the one computing.
    host_budget_bytes: the units' chunks (two versions each) at home in the host tier up to this;
        the rest on NVMe. None: all in the host tier.
    client, socket_dir: the daemon session (default: a session of its own).
    poison: debug: released storage filled with NaN and copies delayed on a thread, so a read
        before its copy shows up as NaN.
    """
    return ParameterStream(model, units, device, device_budget_bytes, prefetch,
                           host_budget_bytes, name, **kwargs)
