"""The device window: the units whose weights are on the device now.

A unit's device memory is one storage per dtype, which its parameters view: fetching resizes it
and copies the weights in from the unit's current versions (on a side stream on a GPU, on a copy
thread on the CPU), evicting it resizes it to nothing. At most `size` units are in the window; the
next `prefetch` units the trace names are fetched ahead, and NVMe-homed units further on are
asked into host memory (by the daemon's planner when the trace is its schedule).

The window owns each unit's place in it, a `Slot`: whether the unit is out, being copied in or in,
the passes using it now, and the copy and the host hold that bring it in. Nothing else writes them;
the hooks, the loader and the stream ask the window (`in_use`, `any_in_use`).
"""
import concurrent.futures
import enum
import threading
import time
from typing import Optional

import torch

from ..client import Access, Acquisition, Tier
from ._figures import StreamFigures
from ._storage import as_tensor, range_view, resize
from ._trace import Trace
from ._units import Unit, Units


class SlotState(enum.Enum):
    OUT = enum.auto()      # its device storage holds nothing
    COPYING = enum.auto()  # in the window: its weights are being copied in
    IN = enum.auto()       # in the window, its weights there


class Slot:
    """A unit's place in the window."""

    def __init__(self):
        self.state = SlotState.OUT
        self.refs = 0             # forward and backward passes using the unit now
        self.host_asked = False   # an NVMe unit's chunks asked into host memory
        self.copy = None          # while COPYING: a Future, or a CUDA event
        self.reading: Optional[Acquisition] = None  # an NVMe unit's hold the copy reads from

    @property
    def in_window(self) -> bool:
        return self.state is not SlotState.OUT


class Window:
    def __init__(self, units: Units, trace: Trace, device: torch.device, prefetch: int,
                 figures: StreamFigures):
        self.units = units
        self._slots = {u.index: Slot() for u in units}
        self.trace = trace
        self.device = device
        self.prefetch = prefetch
        self.size = prefetch + 2
        self.lock = threading.RLock()
        self.live = 0  # bytes on the device: resident tensors and the units in the window
        self.peak = 0
        # A test hook: released storage is filled with NaN and copies are delayed on a thread,
        # so that a read before its copy shows up as NaN (tierd.torch.testing.poison).
        self.poison = False
        self._figures = figures
        self._cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self._cuda else None
        self._pool = None if self._cuda else concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tierd-copy")

    def slot(self, u: Unit) -> Slot:
        return self._slots[u.index]

    def in_use(self, u: Unit) -> bool:
        """Whether a forward or backward uses u now."""
        return self.slot(u).refs > 0

    def any_in_use(self) -> bool:
        return any(slot.refs for slot in self._slots.values())

    def add_resident(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    # ---- use ----

    def use(self, u: Unit, traced: bool, in_backward: bool) -> None:
        """u is needed now (`traced`: by training's forward, recompute or backward, which the
        trace follows; not by a forward without gradients): in the window, its copy waited for."""
        with self.lock:
            if traced:
                self.trace.follow(u)
            else:
                self.trace.pass_by(u)
            slot = self.slot(u)
            if slot.refs == 0 and not slot.in_window:
                self._figures.on_demand += 1
            slot.refs += 1
            self.fetch(u)
            self.wait(u)
            self._prefetch_next(in_backward)

    def unuse(self, u: Unit, in_backward: bool) -> None:
        with self.lock:
            slot = self.slot(u)
            slot.refs -= 1
            if slot.refs == 0 and not self._needed_soon(u, in_backward):
                self.evict(u)

    def _needed_soon(self, u: Unit, in_backward: bool) -> bool:
        """Whether u is among the next units the trace names (the last block of forward is the
        first of backward): kept in the window as a prefetch."""
        for k, nxt in enumerate(self.trace.upcoming(in_backward)):
            if k >= max(self.prefetch, 1):
                return False
            if nxt is u:
                return True
        return False

    def _prefetch_next(self, in_backward: bool) -> None:
        wanted = []
        for nxt in self.trace.upcoming(in_backward):
            if len(wanted) >= self.prefetch:
                break
            if nxt not in wanted:
                wanted.append(nxt)
        for nxt in wanted:
            if self.slot(nxt).in_window:
                continue
            if self.in_window() >= self.size:
                break
            self.fetch(nxt)
        if self.trace.scheduled_ahead():
            return  # the daemon's planner brings NVMe units up, following the schedule
        # NVMe units further on: brought into host memory by the daemon meanwhile.
        ahead = []
        for nxt in self.trace.upcoming(in_backward):
            if len(ahead) >= self.size:
                break
            if nxt.on_nvme() and not self.slot(nxt).in_window and nxt not in ahead:
                ahead.append(nxt)
        ahead = [x for x in ahead if not self.slot(x).host_asked]
        if ahead:
            ids = sorted({i for x in ahead for i in x.current_chunks()})
            self.units.client.prefetch(ids, Tier.HOST)
            for x in ahead:
                self.slot(x).host_asked = True

    def in_window(self) -> int:
        return sum(1 for slot in self._slots.values() if slot.in_window)

    # ---- copies ----

    def fetch(self, u: Unit) -> None:
        """Starts copying u's current weights into its device storage (nothing if there)."""
        slot = self.slot(u)
        if slot.in_window:
            return
        while self.in_window() >= self.size:  # a prefetch not asked for gives way
            idle = [x for x in self.units
                    if self.slot(x).in_window and self.slot(x).refs == 0 and x is not u]
            if not idle:
                self._figures.over_window += 1
                break
            self.evict(idle[0])
        for f in u.flat.values():
            resize(f, f.numel())
            if self.poison:
                f.fill_(float("nan"))
        self.add_resident(u.device_bytes)
        try:
            slot.copy = self._start_copy(u, slot)
        except BaseException:
            if slot.reading is not None:
                slot.reading.release_deferred()
                slot.reading = None
            self._empty(u)  # nothing came in: out again
            raise
        slot.state = SlotState.COPYING
        slot.host_asked = False
        self._figures.fetches += 1
        self._figures.h2d_bytes += u.device_bytes

    def _start_copy(self, u: Unit, slot: Slot):
        """Starts copying u's current weights into its sized storage; the copy to wait for."""
        views = dict(u.views)  # the chunks held in host memory for good
        versions = sorted({r.current for r in u.ranges} - set(views))
        if versions:  # at home on NVMe: held while the copy reads them
            slot.reading = self.units.client.acquire([u.chunk_id(v) for v in versions],
                                                     Tier.HOST, Access.READ)
            for k, v in enumerate(versions):
                views[v] = as_tensor(slot.reading, k, torch.uint8, [u.chunk_size(v)])
        pairs = []
        for r in u.ranges:
            src = range_view(views[r.current], r)[:r.numel]
            dst = u.flat[r.dtype][r.device_offset:r.device_offset + r.numel]
            pairs.append((dst, src))
        if self._cuda:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._side)
            return done
        delay = self.poison

        def copy(pairs=pairs):
            if delay:
                time.sleep(0.002)  # a late copy: a read before it sees NaN
            for dst, src in pairs:
                dst.copy_(src)
        return self._pool.submit(copy)

    def wait(self, u: Unit) -> None:
        """Makes compute wait for u's copy (on a GPU the stream waits, not the host)."""
        slot = self.slot(u)
        if slot.state is not SlotState.COPYING:
            return
        started = time.perf_counter()
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(slot.copy)
            if slot.reading is not None:  # the host copy is read: release it once done
                slot.copy.synchronize()
        else:
            slot.copy.result()
        slot.copy = None
        slot.state = SlotState.IN
        if slot.reading is not None:
            slot.reading.release_deferred()  # the copy's views may outlive this
            slot.reading = None
        self._figures.wait_s += time.perf_counter() - started

    def evict(self, u: Unit) -> None:
        """Takes u out of the window: its device storage goes (its weights stay in its chunks)."""
        slot = self.slot(u)
        if not slot.in_window:
            return
        if slot.state is SlotState.COPYING:  # a prefetch never used: let its copy end first
            self.wait(u)
        self._empty(u)

    def _empty(self, u: Unit) -> None:
        """u's device storage goes: out of the window."""
        for f in u.flat.values():
            if self.poison:
                f.fill_(float("nan"))
            resize(f, 0)
        self.slot(u).state = SlotState.OUT
        self.live -= u.device_bytes

    def evict_unused(self) -> None:
        """Evicts every unit no pass uses now."""
        with self.lock:
            for u in self.units:
                if self.slot(u).refs == 0:
                    self.evict(u)

    def evict_all(self) -> None:
        """After a pass that raised: nothing uses a unit any more, and none stays in the
        window."""
        with self.lock:
            for u in self.units:
                self.slot(u).refs = 0
                self.evict(u)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
