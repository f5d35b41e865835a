"""A streamed model's units and their chunks: which parameters each unit holds, how they are laid
out in its two chunk versions and on the device, and the chunks themselves (placed, held, read,
written). The window, the trace and the hooks build on this; it knows nothing of them.

A unit's parameters are laid out as *ranges*: parameters of one dtype end to end, each range at an
aligned offset in both versions of the unit's chunk, and at an element offset in the unit's device
storage of its dtype. A range's `current` version holds its weights; the other receives the next
step's (_ranges.StreamRange flips it). A unit whose frozen parameters are in a shared base
(_shared_base.py) has ranges of a third kind: in the base's read-only chunk (BASE), never flipped.
"""
import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .._errors import FailedPrecondition, InvalidArgument, InvalidType
from ..client import Access, Acquisition, Client, Completion, Tier
from ._grad_chunks import GradChunks
from ._progress import bar
from ._storage import STEPPED_DTYPES, as_tensor, end_to_end, range_view, resize, storage_empty

ALIGN = 256  # bytes: each range starts at a multiple in its chunk
BASE = 2     # the "version" of a range in the unit's chunk of a shared base (0, 1: its own)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def by_dtype(params: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
    """`params` as one list per dtype, in the order a unit lays dtypes out."""
    return [[p for p in params if p.dtype == d] for d in STEPPED_DTYPES]


class Range:
    """Parameters of one dtype of a unit laid end to end in its chunks (and, on the device, in the
    unit's storage of that dtype). `extra` elements follow the values in the chunks (the sharded
    optimizer's per-parameter flags)."""

    def __init__(self, params: List[torch.Tensor], extra: int):
        self.params = params
        self.dtype = params[0].dtype
        self.sizes, self.offsets, self.numel = end_to_end(params)
        self.extra = extra
        self.offset = 0         # bytes, in each version's chunk
        self.device_offset = 0  # elements, in the unit's device storage of its dtype
        self.current = 0        # the version holding the weights
        # The other version has been written since the last flip (by a step, perhaps abandoned):
        # it may hold new weights that are yet to become current.
        self.writing = False
        self.version_bit = None  # the daemon's bit for its pair, while the schedule has one
        self.grad_chunk = None  # the optimizer's gradients: a scratch chunk (_grad_chunks.py)
        self.retired = False    # the unit was laid out anew: this range is no more
        self.in_base = False    # in the shared base's chunk (current is BASE, for good)

    @property
    def nbytes(self) -> int:
        return (self.numel + self.extra) * self.params[0].element_size()

    def slice(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's elements of a flat view of this range."""
        return flat[self.offsets[i]:self.offsets[i] + self.sizes[i]]


class Unit:
    def __init__(self, index: int, name: str, module: nn.Module, params: List[torch.Tensor]):
        self.index = index
        self.name = name
        self.module = module
        self.params = params
        self.ranges: List[Range] = []
        self.flat: Dict[torch.dtype, torch.Tensor] = {}  # device storage per dtype
        self.chunks = None          # ChunkSet: version 0, version 1
        self.chunk_bytes = 0
        self.home = Tier.HOST
        self.held = None            # a host unit's acquisition of both versions, kept
        self.views: Dict[int, torch.Tensor] = {}  # version -> uint8 view of a held chunk
        self.base = None            # its chunk of a shared base (_base.BaseChunk), if any
        # share_ranks: the gradient chunks of the node's ranks (by local rank; _ranks.py), this
        # rank's among them; its ranges' gradients at their offsets, as the weights.
        self.grad_slabs: Optional[List[int]] = None
        self.slab = 0
        self.base_ranges: List[Range] = []  # its frozen parameters there
        self.edited = set()         # ids of parameters whose weights gathered() changed

    @property
    def device_bytes(self) -> int:
        return sum(r.numel * r.params[0].element_size() for r in self.ranges)

    def chunk_id(self, version: int) -> int:
        return self.base.id if version == BASE else self.chunks.ids[version]

    def chunk_size(self, version: int) -> int:
        return self.base.nbytes if version == BASE else self.chunk_bytes

    def on_nvme(self) -> bool:
        """Whether a chunk it reads is at home on NVMe (its own, or its part of a base)."""
        return self.home == Tier.NVME or (self.base is not None and self.base.home == Tier.NVME)

    def in_base(self, p: torch.Tensor) -> bool:
        """Whether parameter p is in its chunk of a shared base (read-only)."""
        return any(q is p for r in self.base_ranges for q in r.params)

    def own_params(self) -> List[torch.Tensor]:
        """Its parameters in its own chunks (not in a shared base)."""
        return [p for p in self.params if not self.in_base(p)]

    def current_chunks(self) -> List[int]:
        """The chunk ids of the versions its ranges read now."""
        return sorted({self.chunk_id(r.current) for r in self.ranges})


def find_units(model: nn.Module, given: Optional[Sequence[nn.Module]]) -> List[Unit]:
    """The units: the modules given, else the blocks of the model's largest nn.ModuleList of like
    blocks; each with its parameters not also reached from outside the units (tied: resident)."""
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
            raise InvalidArgument("stream_parameters: the model has no nn.ModuleList of like "
                                  "blocks with parameters: name the units (units=[...])")
        given = list(best)
    modules = list(given)
    if not modules:
        raise InvalidArgument("stream_parameters: no units")
    for m in modules:
        if id(m) not in names:
            raise InvalidArgument(f"stream_parameters: a unit ({type(m).__name__}) is not a "
                                  "module of the model")
    ids = {id(m) for m in modules}
    for m in modules:
        for sub in m.modules():
            if sub is not m and id(sub) in ids:
                raise InvalidArgument(f"stream_parameters: unit {names[id(sub)]!r} is inside "
                                      f"unit {names[id(m)]!r}")
    owner: Dict[int, str] = {}
    units = []
    for i, m in enumerate(modules):
        params = []
        for p in m.parameters():  # each once, shared within the unit or not
            if id(p) in owner:
                raise InvalidArgument(f"stream_parameters: a parameter of shape {tuple(p.shape)} "
                                      f"is in two units ({owner[id(p)]!r} and "
                                      f"{names[id(m)]!r}): make it one unit, or keep it out "
                                      "of the units")
            owner[id(p)] = names[id(m)]
            params.append(p)
        units.append(Unit(i, names[id(m)], m, params))
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
            if p.dtype not in STEPPED_DTYPES:
                raise InvalidType(f"stream_parameters: parameter of unit {u.name!r} is "
                                  f"{p.dtype}; OffloadedAdamW steps float32, bfloat16 and "
                                  "float16")
    return [u for u in units if u.params]


def fill(client, chunk: int, view: torch.Tensor, ranges: List[Range], values) -> None:
    """Writes each parameter's value into its place in `chunk`, held for writing (`view`: the
    whole chunk, uint8): a FileSpan (_safetensors.py) is read by the daemon straight from its file
    (Client.import_file, one request per file), a function is called with the place, a tensor is
    copied there."""
    imports: Dict[int, tuple] = {}  # fd -> (size, mtime_ns, [(file, chunk offset, bytes)])
    for r in ranges:
        dst = range_view(view, r)
        for i, p in enumerate(r.params):
            v = values[id(p)]
            out = r.slice(dst, i)
            nbytes = out.numel() * out.element_size()
            if getattr(v, "nbytes", None) == nbytes and hasattr(v, "fd"):  # a FileSpan
                _, _, spans = imports.setdefault(v.fd, (v.size, v.mtime_ns, []))
                spans.append((v.start, out.data_ptr() - view.data_ptr(), nbytes))
            elif callable(v):
                v(out)
            else:
                out.copy_(v)
    for fd, (size, mtime_ns, spans) in imports.items():
        client.import_file(chunk, fd, size, mtime_ns, spans)


class Units:
    """The units of one stream and their chunks in the daemon (through `client`)."""

    def __init__(self, units: List[Unit], client: Client, device: torch.device):
        self.all = units
        self.client = client
        self.device = device
        self.grads = GradChunks(client)  # the optimizer's gradients of the ranges
        self._unit_of: Dict[int, Unit] = {id(p): u for u in units for p in u.params}

    def __iter__(self) -> Iterator[Unit]:
        return iter(self.all)

    def __len__(self) -> int:
        return len(self.all)

    def __getitem__(self, index: int) -> Unit:
        return self.all[index]

    def check_frozen(self) -> None:
        """Raises when a parameter of a shared base has a gradient (made trainable after the
        stream was made): the base is read-only, and leaving it untrained would be a silent
        difference."""
        for u in self.all:
            for r in u.base_ranges:
                for p in r.params:
                    if p.grad is not None:
                        raise FailedPrecondition(
                            f"stream_parameters: a parameter of unit {u.name!r} (shape "
                            f"{tuple(p.shape)}) has a gradient, but it is in a shared base, "
                            "which is read-only: keep it frozen (train adapters beside it), or "
                            "stream without shared_base")

    def unit_of(self, p: torch.Tensor) -> Optional[Unit]:
        return self._unit_of.get(id(p))

    def streams(self, p: torch.Tensor) -> bool:
        return id(p) in self._unit_of

    # ---- chunks ----

    def place(self, host_budget_bytes: Optional[int], has_nvme: bool,
              in_base: Optional[Dict[int, int]] = None, allocate: bool = True) -> None:
        """Each unit's chunks (two versions), at home on the host up to the budget, which
        counts the bytes each unit (by index) has in a shared base being made (`in_base`; its
        own parameters are those not in the base). Without `allocate`, only their sizes and
        homes (the chunks are the ranks' shared ones: _ranks.py)."""
        self.grads.has_nvme = has_nvme
        host_left = host_budget_bytes
        for u in self.all:
            u.chunk_bytes = sum(align(p.numel() * p.element_size() + p.element_size())
                                for p in u.own_params()) + ALIGN * len(STEPPED_DTYPES)
            size = 2 * u.chunk_bytes + (in_base or {}).get(u.index, 0)
            if host_left is None or size <= host_left or not has_nvme:
                u.home = Tier.HOST
                if host_left is not None:
                    host_left -= min(size, host_left)
            else:
                u.home = Tier.NVME
            if not allocate:
                continue
            u.chunks = self.client.allocate([u.chunk_bytes, u.chunk_bytes], u.home)
            if u.home == Tier.HOST:
                u.held = self.client.acquire(u.chunks, Tier.HOST, Access.WRITE)
                for v in (0, 1):
                    u.views[v] = as_tensor(u.held, v, torch.uint8, [u.chunk_bytes])

    def hold(self, u: Unit, version: int, access: Access
             ) -> Tuple[torch.Tensor, Optional[Acquisition]]:
        """A uint8 CPU view of version `version` of u's chunk, and the acquisition to release
        when done (None for a host unit, whose chunks stay held)."""
        if version in u.views:
            return u.views[version], None
        acq = self.client.acquire([u.chunk_id(version)], Tier.HOST, access)
        return as_tensor(acq, 0, torch.uint8, [u.chunk_size(version)]), acq

    def expect(self, r: Range, version: int) -> None:
        """The next forward is expected to read version `version` of r: so says the daemon's
        version bit of r, where the schedule names r's chunks as a pair. A hint: a wrong one
        costs a read, never wrong data. Nothing once the stream's session is closed."""
        if r.version_bit is not None and not self.client.closed:
            self.client.set_version(r.version_bit, version)

    def discard_dead(self, u: Unit, version: int) -> None:
        """Version `version` of u's chunk, which a range has just flipped away from, is dead once
        no range of u's own has it current or is writing a step's new weights into it: nothing
        reads it before the next step overwrites it, so the daemon drops its copies without
        writing them down. For a unit at home on NVMe (a host unit's chunks stay held) whose
        chunks are this rank's own; nothing once the stream's session is closed."""
        if u.home != Tier.NVME or self.client.closed:
            return
        if any(r.current == version or r.writing for r in u.ranges):  # a base's are never
            return
        self.client.discard([u.chunks.ids[version]])

    @contextlib.contextmanager
    def holding(self, u: Unit, version: int, access: Access):
        """hold() for a with block (released once the views made from it are gone)."""
        view, acq = self.hold(u, version, access)
        try:
            yield view
        finally:
            if acq is not None:
                acq.release_deferred()

    def weights(self, u: Unit) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Every parameter of u with a copy of its current weights (flat, on the CPU)."""
        out = []
        for v in (0, 1, BASE):
            rs = [r for r in u.ranges if r.current == v]
            if not rs:
                continue
            with self.holding(u, v, Access.READ) as view:
                for r in rs:
                    values = range_view(view, r)
                    for i, p in enumerate(r.params):
                        out.append((p, r.slice(values, i).clone()))
        return out

    def write_weights(self, u: Unit, changed: Dict[int, torch.Tensor]) -> None:
        """Writes new weights (parameter id -> flat CPU values of its dtype) into u's current
        versions and marks them edited (the optimizer takes them as its master weights at its
        next step). A parameter in a shared base is refused: the base is read-only."""
        for r in u.ranges:
            if r.in_base and any(id(p) in changed for p in r.params):
                raise InvalidArgument(f"unit {u.name!r}: a parameter in the shared base is "
                                      "read-only")
        for r in u.ranges:
            if not any(id(p) in changed for p in r.params):
                continue
            with self.holding(u, r.current, Access.WRITE) as view:
                values = range_view(view, r)
                for i, p in enumerate(r.params):
                    if id(p) in changed:
                        r.slice(values, i).copy_(changed[id(p)])
        u.edited |= set(changed)

    # ---- layout ----

    def lay_out(self, u: Unit, groups: List[List[torch.Tensor]], extra_per_param: int,
                values: Dict[int, torch.Tensor], write: bool = True) -> None:
        """Lays u out as one range per (non-empty) list of its own parameters, each of one
        dtype, and writes `values` (parameter id -> flat weights, or a function that writes them
        into the flat tensor it is given) into version 0, current in every range; its ranges in
        a shared base stay where they are, after them on the device. Without `write`, the layout
        only (another rank of the node writes the chunks they share).
        The old ranges are retired, their gradient chunks freed."""
        ranges = [Range(g, extra_per_param * len(g)) for g in groups if g]
        offset = 0
        device_offsets: Dict[torch.dtype, int] = {}
        for r in ranges:
            r.offset = offset
            offset += align(r.nbytes)
        for r in ranges + u.base_ranges:
            r.device_offset = device_offsets.get(r.dtype, 0)
            device_offsets[r.dtype] = r.device_offset + r.numel
        if offset > u.chunk_bytes:
            raise InvalidArgument(f"stream_parameters: unit {u.name!r} needs {offset} bytes of "
                                  f"chunk for this layout, it has {u.chunk_bytes}")
        self.grads.free_unit(u)
        for r in u.ranges:
            r.retired = not r.in_base
        u.ranges = ranges + u.base_ranges
        u.flat = {d: torch.empty(n, dtype=d, device=self.device)
                  for d, n in device_offsets.items()}
        for f in u.flat.values():
            resize(f, 0)
        if not write:
            self.point(u)
            return
        with self.holding(u, 0, Access.OVERWRITE) as view:
            fill(self.client, u.chunk_id(0), view, ranges, values)
        self.point(u)

    def lay_out_all(self, values_of, write: bool, what: str, progress: Optional[bool]) -> None:
        """Every unit laid out as one range per dtype of its own parameters, its weights written
        from values_of(module, params) (lay_out's `values`; one unit's in the process at a time)
        and an NVMe unit's written down, counted by a progress bar named `what` (_progress.py);
        without `write`, the layout only."""
        written = []
        total = sum(p.numel() * p.element_size() for u in self.all for p in u.own_params())
        with bar(what, total if write else 0, progress) as done:
            for u in self.all:
                own = u.own_params()
                values = values_of(u.module, own) if own and write else {}
                self.lay_out(u, by_dtype(own), 1, values, write=write)
                if write:
                    written.append(self.write_down(u))
                    done(sum(p.numel() * p.element_size() for p in own))
        for w in written:
            if w is not None:
                w.wait()

    def write_down(self, u: Unit) -> Optional[Completion]:
        """An NVMe unit's version 0, just written (laid out), goes down to NVMe now rather than
        when room is next needed: an import larger than the host tier flows through it, and a
        frozen unit is never written again. None for a host unit. (Call it once the views of
        lay_out's writes are gone: a chunk still acquired does not move.)"""
        if u.home != Tier.NVME:
            return None
        return self.client.evict([u.chunks.ids[0]], Tier.NVME)

    def point(self, u: Unit) -> None:
        """Points u's parameters at their places in its device storage (an empty one made with
        room for a moment: a view of an empty storage cannot be taken)."""
        empty = [f for f in u.flat.values() if storage_empty(f)]
        for f in empty:
            resize(f, f.numel())
        with torch.no_grad():
            for r in u.ranges:
                flat = u.flat[r.dtype]
                for i, p in enumerate(r.params):
                    start = r.device_offset + r.offsets[i]
                    p.data = flat[start:start + r.sizes[i]].view(p.shape)
        for f in empty:
            resize(f, 0)

    def free(self, u: Unit) -> None:
        """Frees u's chunks (its weights are to be read first)."""
        u.views = {}
        self.grads.free_unit(u)
        if u.base is not None:
            u.base.let_go()
        if u.held is not None:
            u.held.release_deferred()
        if u.chunks is not None:
            u.chunks.free_deferred()
        u.held = u.chunks = None
