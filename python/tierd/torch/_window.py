"""The device window: the units whose weights are on the device now.

A unit's device memory is one storage per dtype, which its parameters view: fetching resizes it
and copies the weights in from the unit's current versions (on a side stream on a GPU, on a copy
thread on the CPU), evicting it resizes it to nothing. At most `size` units are in the window; the
next `prefetch` units the trace names are fetched ahead, and NVMe-homed units further on are
asked into host memory (by the daemon's planner when the trace is its schedule).
"""
import concurrent.futures
import threading
import time
from typing import Dict

import torch

from ..client import Access, Tier
from ._storage import as_tensor, range_view, resize
from ._trace import Trace
from ._units import Unit, Units


class Window:
    def __init__(self, units: Units, trace: Trace, device: torch.device, prefetch: int,
                 stats: Dict[str, float]):
        self.units = units
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
        self._stats = stats
        self._cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self._cuda else None
        self._pool = None if self._cuda else concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tierd-copy")

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
            if u.refs == 0 and not u.materialized:
                self._stats["on_demand"] += 1
            u.refs += 1
            self.fetch(u)
            self.wait(u)
            self._prefetch_next(in_backward)

    def unuse(self, u: Unit, in_backward: bool) -> None:
        with self.lock:
            u.refs -= 1
            if u.refs == 0 and not self._needed_soon(u, in_backward):
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
            if nxt.materialized:
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
            if nxt.on_nvme() and not nxt.materialized and nxt not in ahead:
                ahead.append(nxt)
        ahead = [x for x in ahead if not x.host_asked]
        if ahead:
            ids = sorted({i for x in ahead for i in x.current_chunks()})
            self.units.client.prefetch(ids, Tier.HOST)
            for x in ahead:
                x.host_asked = True

    def in_window(self) -> int:
        return sum(1 for x in self.units if x.materialized)

    # ---- copies ----

    def fetch(self, u: Unit) -> None:
        """Starts copying u's current weights into its device storage (nothing if there)."""
        if u.materialized:
            return
        while self.in_window() >= self.size:  # a prefetch not asked for gives way
            idle = [x for x in self.units if x.materialized and x.refs == 0 and x is not u]
            if not idle:
                self._stats["over_window"] += 1
                break
            self.evict(idle[0])
        for f in u.flat.values():
            resize(f, f.numel())
            if self.poison:
                f.fill_(float("nan"))
        u.materialized = True
        u.host_asked = False
        self.add_resident(u.device_bytes)
        self._stats["fetches"] += 1
        self._stats["h2d_bytes"] += u.device_bytes
        views = dict(u.views)  # the chunks held in host memory for good
        versions = sorted({r.current for r in u.ranges} - set(views))
        if versions:  # at home on NVMe: held while the copy reads them
            u.reading = self.units.client.acquire([u.chunk_id(v) for v in versions], Tier.HOST,
                                                  Access.READ)
            for k, v in enumerate(versions):
                views[v] = as_tensor(u.reading, k, torch.uint8, [u.chunk_size(v)])
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

    def wait(self, u: Unit) -> None:
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
            u.reading.release_deferred()  # the copy's views may outlive this
            u.reading = None
        self._stats["wait_s"] += time.perf_counter() - started

    def evict(self, u: Unit) -> None:
        """Takes u out of the window: its device storage goes (its weights stay in its chunks)."""
        if not u.materialized:
            return
        if u.copy is not None:  # a prefetch never used: let its copy end first
            self.wait(u)
        for f in u.flat.values():
            if self.poison:
                f.fill_(float("nan"))
            resize(f, 0)
        u.materialized = False
        self.live -= u.device_bytes

    def evict_unused(self) -> None:
        """Evicts every unit no pass uses now."""
        with self.lock:
            for u in self.units:
                if u.refs == 0 and u.materialized:
                    self.evict(u)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
