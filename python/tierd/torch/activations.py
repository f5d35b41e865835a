"""Activation offload: tensors autograd saves for backward kept in tierd chunks, not in the process.

    offload = tierd.torch.offload_activations(min_bytes=1 << 16, host_budget_bytes=256 << 20)
    for batch in data:
        with offload:                   # one forward
            loss = model(batch)
        loss.backward()                 # saved tensors come back, read ahead in backward's order

Saved tensors of at least `min_bytes` are packed into slabs: chunks of `slab_bytes` filled one
after another, so that a saved tensor costs no call to the daemon; a slab is allocated once and
reused by every later forward. Slabs are at home in the host tier up to `host_budget_bytes`: those
stay acquired (and viewed) from their first forward until `close()`, so a step costs no call to
the daemon for them at all. Slabs beyond the budget are at home on NVMe and cost one acquisition
and one release per forward and per backward: they are written down once full, all but the last
`read_ahead`, which backward needs first. Backward unpacks in reverse order; the first tensor it
needs from an NVMe slab brings that slab in and asks for the next `read_ahead` slabs, so NVMe
reads run ahead of backward. Unpacking copies a tensor out of its slab (onto the GPU when it came
from there), so an NVMe slab is released as soon as backward has taken all of its tensors.

On a GPU, tensors are copied out on a side stream that waits for the compute stream, and backward's
stream waits for those copies (an event, not the host) before reading a slab; the host waits for
the copies only before releasing an NVMe slab to the daemon.

A tensor saved twice in one forward (the same memory, unchanged, alive in between) is stored once.
Parameters, views of parameters, tensors that are not contiguous or are of another layout stay
where they are. The bytes come back exactly as they were saved: gradients are those of the run
without offload.
"""
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.utils.dlpack

from .._errors import FailedPrecondition, InvalidArgument
from ..client import Access, Client, Tier, TierdError, connect

__all__ = ["ActivationOffload", "ActivationStats", "offload_activations"]

_ALIGN = 256  # every tensor starts at a multiple of this in its slab (vector loads, DMA)
_TYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool}


@dataclass
class ActivationStats:
    """Counters since the offload was made."""
    saved: int = 0          # tensors autograd handed to the pack hook
    stored: int = 0         # of them, written into slabs
    deduplicated: int = 0   # of them, already stored in this forward
    kept: int = 0           # of them, left in the process (small, parameters, not contiguous)
    stored_bytes: int = 0
    nvme_written_bytes: int = 0  # slabs written down to NVMe
    nvme_read_bytes: int = 0     # slabs brought back for backward
    slabs: int = 0               # allocated (once; reused by later forwards)
    pack_seconds: float = 0.0    # time in the pack and unpack hooks
    unpack_seconds: float = 0.0


class _Slab:
    """A chunk that saved tensors are packed into, one after another."""

    def __init__(self, ids, size: int, home: Tier):
        self.chunks = ids      # the ChunkSet (one chunk)
        self.id = ids.ids[0]
        self.size = size
        self.home = home
        self.used = 0
        self.held = None       # the Acquisition while written or read (always, for host slabs)
        self.buf = None        # a uint8 tensor over the whole slab while held
        self.handles = 0       # saved tensors in it this forward (one stored twice counts twice)
        self.unpacked = 0      # of them, taken by backward at least once
        self.live = 0          # packed handles still referring to it
        self.in_host = True    # False once written down to NVMe
        self.on_nvme = False   # its bytes of this forward are on NVMe (host copies are clean)
        self.moving = None     # the eviction or read-ahead in flight
        self.copies = None     # a CUDA event after the last copy in (or, NVMe slabs, out)
        self.forward = None    # the forward it holds tensors of


class _Entry:
    __slots__ = ("slab", "offset", "nbytes")

    def __init__(self, slab: _Slab, offset: int, nbytes: int):
        self.slab = slab
        self.offset = offset
        self.nbytes = nbytes


class _Packed:
    """What autograd keeps in place of a saved tensor."""
    __slots__ = ("owner", "entry", "shape", "dtype", "device", "unpacked", "__weakref__")

    def __init__(self, owner: "ActivationOffload", entry: _Entry, t: torch.Tensor):
        self.owner = owner
        self.entry = entry
        self.shape = t.shape
        self.dtype = t.dtype
        self.device = t.device
        self.unpacked = False
        entry.slab.live += 1
        entry.slab.handles += 1

    def __del__(self):
        owner = self.owner
        if owner is not None:
            owner._drop(self.entry)


class _Forward:
    """The slabs one forward filled, in order, and what it stored."""

    def __init__(self):
        self.slabs: List[_Slab] = []
        self.seen: Dict[tuple, tuple] = {}  # (address, bytes, device, version) -> (tensor ref, entry)
        self.closed = False


class ActivationOffload:
    """Packs saved tensors into tierd chunks during each forward run inside `with offload:`.

    client: a tierd.Client (default: a session of its own, from socket_dir or $TIERD_SOCKET_DIR).
    min_bytes: smaller saved tensors stay in the process.
    host_budget_bytes: slab bytes at home in the host tier; the rest are at home on NVMe (when
        the daemon has no NVMe tier, every slab is in host memory and the daemon's capacity is
        the bound).
    slab_bytes: a slab's size (a bigger tensor gets a slab of its own, up to the daemon's largest
        chunk; one larger still stays in the process).
    read_ahead: NVMe slabs kept in, or brought ahead into, host memory for backward.
    """

    def __init__(self, client: Optional[Client] = None, socket_dir: Optional[str] = None,
                 min_bytes: int = 1 << 16, host_budget_bytes: int = 256 << 20,
                 slab_bytes: int = 4 << 20, read_ahead: int = 2):
        if min_bytes < 1 or slab_bytes < _ALIGN or read_ahead < 0 or host_budget_bytes < 0:
            raise InvalidArgument("min_bytes and slab_bytes must be positive, read_ahead and "
                                  "host_budget_bytes not negative")
        self._own_client = client is None
        self._client = client if client is not None else connect(socket_dir, "activations")
        self.min_bytes = int(min_bytes)
        self.host_budget_bytes = int(host_budget_bytes)
        self.slab_bytes = int(slab_bytes)
        self.read_ahead = int(read_ahead)
        self._nvme = self._client.tier_usage(Tier.NVME).configured
        self._lock = threading.RLock()
        self._slabs: List[_Slab] = []
        self._host_home_bytes = 0
        self._forward: Optional[_Forward] = None
        self._hooks = None
        self._stream = None      # the side stream GPU tensors are copied out on
        self._cuda_ready = False
        self._too_big_warned = False
        self.stats = ActivationStats()

    # ---- the context: one forward ----
    def __enter__(self) -> "ActivationOffload":
        if self._forward is not None:
            raise FailedPrecondition("offload_activations: already inside a forward")
        if self._client is None:
            raise FailedPrecondition("offload_activations: closed")
        self._forward = _Forward()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)
        forward, self._forward = self._forward, None
        with self._lock:
            forward.closed = True
            forward.seen.clear()
            if forward.slabs:
                self._close(forward.slabs[-1])
            for slab in forward.slabs:
                self._recycle_if_unused(slab)

    def close(self) -> None:
        """Frees every slab (refused while a graph still holds tensors in them) and, when the
        offload made its own session, closes it."""
        with self._lock:
            if any(s.live for s in self._slabs):
                raise FailedPrecondition("offload_activations: a graph still holds saved tensors; "
                                         "run or drop its backward first")
            for slab in self._slabs:
                self._let_go(slab, keep=False)
                self._settle(slab)
                slab.chunks.free()
            self._slabs = []
            if self._own_client and self._client is not None:
                self._client.close()
            self._client = None

    # ---- pack: in forward ----
    def _eligible(self, t: torch.Tensor) -> bool:
        if t.layout != torch.strided or t.dtype not in _TYPES or not t.is_contiguous():
            return False
        if t.device.type not in ("cpu", "cuda"):
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        base = t._base if t._base is not None else t
        return not (base.is_leaf and base.requires_grad)  # parameters stay with the model

    def _pack(self, t: torch.Tensor):
        started = time.perf_counter()
        try:
            return self._store(t)
        finally:
            self.stats.pack_seconds += time.perf_counter() - started

    def _store(self, t: torch.Tensor):
        with self._lock:
            self.stats.saved += 1
            forward = self._forward
            if forward is None or not self._eligible(t):
                self.stats.kept += 1
                return t
            nbytes = t.numel() * t.element_size()
            key = (t.data_ptr(), nbytes, str(t.device), t._version)
            hit = forward.seen.get(key)
            if hit is not None and hit[0]() is not None:
                self.stats.deduplicated += 1
                return _Packed(self, hit[1], t)
            slab = self._room(forward, nbytes)
            if slab is None:
                self.stats.kept += 1
                return t
            offset = slab.used
            slab.used = (offset + nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            entry = _Entry(slab, offset, nbytes)
            self._copy_in(slab, offset, t, nbytes)
            forward.seen[key] = (weakref.ref(t), entry)
            self.stats.stored += 1
            self.stats.stored_bytes += nbytes
            return _Packed(self, entry, t)

    def _copy_in(self, slab: _Slab, offset: int, t: torch.Tensor, nbytes: int) -> None:
        src = t.detach().reshape(-1).view(torch.uint8)
        dst = slab.buf[offset:offset + nbytes]
        if t.is_cuda:
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            t.record_stream(stream)  # its memory is not reused before the copy is done
            slab.copies = torch.cuda.Event()
            slab.copies.record(stream)
        else:
            dst.copy_(src)

    def _side_stream(self, device):
        if self._stream is None:
            if not self._cuda_ready:
                self._cuda_ready = True
                try:
                    self._client.cuda_device()  # registers the host segments for DMA
                except TierdError as e:  # e.g. a daemon without the GPU: copies are staged
                    warnings.warn(f"offload_activations: host segments not registered with "
                                  f"CUDA, copies to and from the GPU are staged ({e})")
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _room(self, forward: _Forward, nbytes: int) -> Optional[_Slab]:
        """The slab the next `nbytes` go into: the current one, else a free one (host-home ones
        first), else a new one."""
        if forward.slabs:
            current = forward.slabs[-1]
            if current.used + nbytes <= current.size:
                return current
            self._close(current)
        need = max(self.slab_bytes, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        free = [s for s in self._slabs if s.forward is None and s.size >= need]
        free.sort(key=lambda s: (s.home != Tier.HOST, s.size))
        slab = free[0] if free else self._new_slab(need)
        if slab is None:
            return None
        self._settle(slab)
        self._hold(slab, Access.OVERWRITE)
        slab.used = slab.handles = slab.unpacked = 0
        slab.in_host = True
        slab.on_nvme = False
        slab.forward = forward
        forward.slabs.append(slab)
        return slab

    def _new_slab(self, size: int) -> Optional[_Slab]:
        home = Tier.HOST
        if self._nvme and self._host_home_bytes + size > self.host_budget_bytes:
            home = Tier.NVME
        try:
            chunks = self._client.allocate([size], home)
        except TierdError as e:
            if e.code_name not in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED") or size == \
                    self.slab_bytes:
                raise
            if not self._too_big_warned:  # a tensor larger than the daemon's largest chunk
                self._too_big_warned = True
                warnings.warn(f"offload_activations: a {size}-byte saved tensor stays in the "
                              f"process ({e.message})")
            return None
        slab = _Slab(chunks, chunks.sizes[0], home)
        if home == Tier.HOST:
            self._host_home_bytes += size
        self._slabs.append(slab)
        self.stats.slabs += 1
        return slab

    def _close(self, slab: _Slab) -> None:
        """A slab is full (or the forward ended): its bytes are handed to the daemon, and an
        NVMe-home slab goes down once read_ahead later ones are waiting in host memory."""
        if slab.held is None:
            return
        self._let_go(slab)
        forward = slab.forward
        waiting = [s for s in forward.slabs if s.home == Tier.NVME and s.in_host and
                   s.held is None and s.moving is None]
        for old in waiting[:max(len(waiting) - self.read_ahead, 0)]:
            self._write_down(old)

    def _write_down(self, slab: _Slab) -> None:
        slab.moving = self._client.evict(slab.chunks, Tier.NVME)
        slab.in_host = False
        slab.on_nvme = True
        self.stats.nvme_written_bytes += slab.size  # the daemon moves whole chunks

    def _hold(self, slab: _Slab, access: Access) -> None:
        """Acquires a slab in host memory and views it as bytes (once they are in place); a host
        slab acquired before still is."""
        if slab.held is not None:
            return
        if slab.home == Tier.HOST:
            access = Access.WRITE  # kept for every later forward and backward
        slab.held = self._client.acquire(slab.chunks, Tier.HOST, access)
        slab.buf = torch.utils.dlpack.from_dlpack(slab.held.dlpack(0, "uint8", [slab.size]))

    def _let_go(self, slab: _Slab, keep: bool = True) -> None:
        """Waits for the GPU's copies into or out of a slab, drops the view and releases it; a
        host slab is kept (unless `keep` is False): nothing to wait for or release."""
        if keep and slab.home == Tier.HOST:
            return
        if slab.copies is not None:
            slab.copies.synchronize()
            slab.copies = None
        slab.buf = None
        if slab.held is not None:
            slab.held.release()
            slab.held = None

    def _settle(self, slab: _Slab) -> None:
        if slab.moving is not None:
            moving, slab.moving = slab.moving, None
            moving.wait()

    # ---- unpack: in backward ----
    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        started = time.perf_counter()
        with self._lock:
            entry = packed.entry
            slab = entry.slab
            if slab.held is None:
                self._bring_in(slab)
            out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
            src = slab.buf[entry.offset:entry.offset + entry.nbytes]
            dst = out.view(-1).view(torch.uint8)
            if out.is_cuda:
                stream = torch.cuda.current_stream(out.device)
                if slab.home == Tier.HOST:
                    # The side stream's copies in come first (on the GPU; the next forward's
                    # copies in wait for this stream in turn).
                    if slab.copies is not None:
                        stream.wait_event(slab.copies)
                        slab.copies = None
                    dst.copy_(src, non_blocking=True)
                else:  # copies out that must end before the slab is released
                    dst.copy_(src, non_blocking=True)
                    slab.copies = torch.cuda.Event()
                    slab.copies.record(stream)
            else:
                dst.copy_(src)
            del src, dst
            if not packed.unpacked:
                packed.unpacked = True
                slab.unpacked += 1
            if slab.unpacked >= slab.handles and slab.forward is not None and \
                    slab.forward.closed:
                self._drain(slab)
            self.stats.unpack_seconds += time.perf_counter() - started
            return out

    def _bring_in(self, slab: _Slab) -> None:
        """Holds a slab in host memory for reading, and asks for the next ones backward needs."""
        self._settle(slab)
        if not slab.in_host:
            self.stats.nvme_read_bytes += slab.size
        self._hold(slab, Access.READ)
        slab.in_host = True
        forward = slab.forward
        if forward is None:
            return
        before = forward.slabs[:forward.slabs.index(slab)]
        ahead = [s for s in reversed(before) if not s.in_host][:self.read_ahead]
        for s in ahead:
            self._settle(s)
            s.moving = self._client.prefetch(s.chunks, Tier.HOST)
            s.in_host = True
            self.stats.nvme_read_bytes += s.size

    def _drain(self, slab: _Slab) -> None:
        """Backward has taken every tensor of the slab: let it go. One brought back from NVMe
        drops its (clean) host copy; one never written down stays: writing bytes no one will read
        again would only cost the drive, and the next forward overwrites them."""
        self._let_go(slab)
        if slab.on_nvme and slab.in_host:
            slab.moving = self._client.evict(slab.chunks, Tier.NVME)
            slab.in_host = False

    # ---- a graph let go of its saved tensors ----
    def _drop(self, entry: _Entry) -> None:
        with self._lock:
            slab = entry.slab
            slab.live -= 1
            self._recycle_if_unused(slab)

    def _recycle_if_unused(self, slab: _Slab) -> None:
        forward = slab.forward
        if slab.live > 0 or forward is None or not forward.closed:
            return
        if slab.held is not None:  # taken by a backward that stopped early
            self._drain(slab)
        slab.forward = None

    def __del__(self):
        try:
            if self._forward is None and self._client is not None:
                self.close()
        except Exception:
            pass


def offload_activations(**kwargs) -> ActivationOffload:
    """An ActivationOffload (its arguments): make it once, enter it around every forward."""
    return ActivationOffload(**kwargs)
