"""The optimizer's gradients of a streamed unit's ranges, in chunks of their own.

Each range that receives gradients gets a scratch chunk (its values and extras, of its dtype),
made at its first gradient and freed after the step; with share_ranks, the node's ranks instead
leave their gradients in one chunk per rank (_ranks.py), at the offsets the weights have, and the
range's gradients of every rank are summed where they lie. Below _units, which owns one of these
for its units and frees a unit's gradients with its chunks: it knows a unit and a range only by
the fields it reads (home, grad_slabs, slab, chunk_bytes; grad_chunk, nbytes, numel, extra, dtype).
"""
import torch

from .._abi import Status
from ..client import Access, Client, Tier, TierdError
from ._storage import as_tensor, range_view


class GradChunks:
    def __init__(self, client: Client):
        self.client = client
        # The daemon has an NVMe tier: a host unit's gradient chunk goes there when the host tier
        # has no room for it (Units.place sets it).
        self.has_nvme = False

    def make(self, u, r) -> None:
        """Range r's gradient chunk: a scratch chunk at home where the unit is (on NVMe, it can
        be written down while the step runs if the host tier needs the room; a host unit's goes
        to NVMe too when the host tier has no room for it, where the daemon makes room by writing
        other copies down), made when its first gradient comes (a range of frozen parameters
        never has one). Transient: freed after the step, it is not written down early while the
        NVMe path is idle."""
        if r.grad_chunk is not None:
            return
        size = [max(r.nbytes, 1)]
        try:
            r.grad_chunk = self.client.allocate(size, u.home, transient=True)
        except TierdError as e:
            if u.home != Tier.HOST or e.code != Status.RESOURCE_EXHAUSTED or not self.has_nvme:
                raise
            r.grad_chunk = self.client.allocate(size, Tier.NVME, transient=True)

    def hold(self, u, r, keep: bool = False, tier: Tier = Tier.HOST):
        """(a view of range r's gradients, its acquisition to release when done, whose `host`
        says where it is held). keep: what the chunk holds is wanted (gradients held again),
        else overwritten. `tier`: the host, or the device for a range stepped by the optimizer's
        device lane (its gradients then never cross the link: copied there on the device, read
        there by the kernels); the host where the device tier cannot hold it now. With the
        ranks' gradient chunks, its range of this rank's (held for writing, in the host: the
        other ranges of the chunk keep what they hold)."""
        if u.grad_slabs is not None:
            held = self.client.acquire([u.grad_slabs[u.slab]], Tier.HOST, Access.WRITE)
            view = as_tensor(held, 0, torch.uint8, [u.chunk_bytes])
            return range_view(view, r), held
        self.make(u, r)
        access = Access.WRITE if keep else Access.OVERWRITE
        held = None
        if tier == Tier.DEVICE:
            try:
                held = self.client.acquire(r.grad_chunk, Tier.DEVICE, access)
                held.ready.wait()
            except TierdError as e:
                # No room now, or a chunk larger than the device tier's segments: the host's
                # acquire below says what is wrong where it cannot hold it either.
                if e.code not in (Status.RESOURCE_EXHAUSTED, Status.INVALID_ARGUMENT):
                    raise
                if held is not None:  # room that did not come in time
                    held.release_deferred()
                held = None
        if held is None:
            held = self.client.acquire(r.grad_chunk, Tier.HOST, access)
        return as_tensor(held, 0, r.dtype, [r.numel + r.extra]), held

    def sum_ranks(self, u, r, mine: torch.Tensor) -> None:
        """Range r's gradients of every rank on the node summed into `mine` (this rank's, held),
        read where each rank's backward left them: ((g0 + g1) + g2) + ..., in rank order, in the
        range's dtype, whichever rank sums."""
        others = [k for k in range(len(u.grad_slabs)) if k != u.slab]
        if not others:  # one rank on the node: its gradients are the node's sum
            return
        held = self.client.acquire([u.grad_slabs[k] for k in others], Tier.HOST, Access.READ)
        try:
            views = {k: range_view(as_tensor(held, i, torch.uint8, [u.chunk_bytes]),
                                   r)[:r.numel] for i, k in enumerate(others)}
            views[u.slab] = mine[:r.numel]
            # Summed into this rank's own when it is the first (else a copy of the first, so
            # that the order stays the same).
            total = views[0] if u.slab == 0 else views[0].clone()
            for k in range(1, len(u.grad_slabs)):
                total.add_(views[k])
            if u.slab != 0:
                views[u.slab].copy_(total)
            del views, total
        finally:
            held.release_deferred()

    def free(self, r) -> None:
        """Range r's gradient chunk goes (made anew at its next first gradient)."""
        if r.grad_chunk is not None:
            chunks, r.grad_chunk = r.grad_chunk, None
            chunks.free_deferred()

    def free_unit(self, u) -> None:
        """The gradient chunks of every range of u go."""
        for r in u.ranges:
            self.free(r)
