"""ZeRO-1 for OffloadedAdamW: the optimizer's buckets shared out among data-parallel ranks.

Each rank owns some buckets (balanced by parameter count, the same assignment on every rank) and
keeps only their state in tierd. A step is: every rank's gradients of a bucket summed into its
owner (a reduce, started as soon as the bucket is complete in backward), the owner steps it, and
every owner broadcasts its buckets' new weights to all ranks. The collectives run over gloo on
the pinned host buffers the optimizer already copies gradients into, so they work beside any
backend the model uses (NCCL included: a gloo group is made next to it).

Collectives of one group must be issued in the same order on every rank. They run over the
active buckets (those with a parameter in the groups, the same on every rank) in the order they
were made. Reduces are issued in that order only: a bucket complete early in backward waits for
the buckets before it, and step() issues whatever backward did not. Each buffer carries one extra
element per parameter: the count of ranks that had a gradient for it (reduces) or the flags its
owner stepped it with (broadcasts), so that a parameter no rank had a gradient for is left as it
is, as in one process (DDP averages over the ranks, the ranks without one adding zeros).

A bucket whose weights and gradient chunks the ranks of each node share (share_ranks: b.nodes,
_ranks.Nodes) moves less. Its gradients: the counts alone are reduced over the node to the
bucket's node owner (the rank of the owner's local index), which sums the node's gradients where
they lie, in local rank order; on several nodes, the node sums (with the counts) are reduced over
the node owners to the owner (torch.distributed's order, fixed for a number of nodes). Its new
weights: the owner writes them into its node's next version, broadcasts them to the other nodes'
node owners (into theirs), and each node owner tells its node the flags alone.
"""
import collections
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._errors import FailedPrecondition, InvalidArgument
from ._agree import all_succeeded


def _global_rank(group, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    convert = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return convert(group, rank)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """The ranks an optimizer is sharded over, and its collectives of one step."""

    @staticmethod
    def create(process_group) -> Optional["Comm"]:
        """None when there is nothing to shard over: no process group given and torch.distributed
        not initialised, or a world of one."""
        if process_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                return None
            process_group = dist.group.WORLD
        if dist.get_world_size(process_group) != dist.get_world_size():
            raise InvalidArgument("OffloadedAdamW: process_group must span every rank (each rank "
                                  "owns a share of the state and all take part in every step)")
        if dist.get_world_size() == 1:
            return None
        return Comm(process_group)

    def __init__(self, process_group):
        # A gloo group of its own, made by every rank at the same point (all of them construct
        # the optimizer): its collectives, issued from backward's hooks, never interleave with
        # others on the given group (DDP's all-reduces, issued from hooks of its own), which
        # gloo would take as a mismatch and abort the process on.
        self.group = dist.new_group(backend="gloo")  # process_group spans every rank
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._next = 0       # the next bucket whose reduce is to be issued this step
        self._works = {}     # bucket serial -> the reduce into this rank, its owner, in flight
        self._summing = collections.deque()  # (bucket, its reduce over the node) to sum here
        self._sent = []      # this rank's reduces into other ranks, waited for at the end
        self.early = 0       # reduces issued during this step's backward
        self.moved = 0       # bytes this rank put through torch.distributed since take_moved()

    def assign(self, buckets, existing) -> None:
        """Sets each new bucket's owner (balanced by parameters with the `existing` ones, the same
        on every rank) and the owned ones' slots in the order given (b.slot: 0, 1, ... here, the
        caller moves them after its own; None for others' buckets)."""
        if not existing and len(buckets) < self.world:
            raise InvalidArgument(f"OffloadedAdamW: {len(buckets)} buckets cannot be shared by "
                                  f"{self.world} ranks: lower bucket_params")
        load = [0] * self.world
        for b in existing:
            load[b.owner] += b.numel
        slot = 0
        for b in buckets:  # largest first would balance better, but order keeps it simple
            owner = min(range(self.world), key=lambda r: (load[r], r))
            load[owner] += b.numel
            b.owner = owner
            b.slot = None
            if owner == self.rank:
                b.slot = slot
                slot += 1

    def all_succeeded(self, doing: str, error: Optional[BaseException]) -> None:
        """Every rank's outcome of `doing` (_agree.all_succeeded)."""
        all_succeeded(self.group, "OffloadedAdamW", doing, error)

    def agree_on_state(self, resumed: bool, steps: int) -> None:
        """Every rank's share of the state resumed or none, and all at the same step."""
        self.agree("whether the state was resumed", int(resumed))
        self.agree("the steps taken", steps)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def agree(self, what: str, value: int) -> None:
        """Raises on every rank when the ranks' values differ (resumed or not, steps taken)."""
        mine = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group)
        if int(mine[0]) != -int(mine[1]):
            raise FailedPrecondition(f"OffloadedAdamW: the ranks' shards disagree on {what} (from "
                                     f"{-int(mine[1])} to {int(mine[0])}): resume every rank's "
                                     "state from the same run, with the same number of ranks")

    # ---- gradients ----

    def reduce_ready(self, buckets, force: bool = False) -> None:
        """Issues the reduces of the complete buckets in bucket order from the next one (all the
        rest when `force`: the gradients of every bucket not yet issued are in place)."""
        while self._next < len(buckets):
            b = buckets[self._next]
            if not force and not b.this_step.complete:
                return
            self.early += 0 if force else 1
            if b.this_step.event is not None:
                b.this_step.event.synchronize()
            b.buffers.hold_grads()
            grad_ext = b.buffers.grad_ext
            grad_ext[b.numel:] = torch.tensor([1.0 if g else 0.0 for g in b.this_step.got])
            owner = _global_rank(self.group, b.owner)
            nodes = b.nodes
            if nodes is None:
                work = dist.reduce(grad_ext, dst=owner, group=self.group, async_op=True)
                self._works[b.serial] = work
                self.moved += _nbytes(grad_ext)
            else:  # the counts alone, to the rank of the node that sums the node's gradients
                here = nodes.node_owner(owner)
                work = dist.reduce(grad_ext[b.numel:], dst=here, group=nodes.group,
                                   async_op=True)
                self.moved += _nbytes(grad_ext[b.numel:])
                if here == dist.get_rank():
                    self._summing.append((b, work))
                else:
                    self._sent.append(work)
            self._next += 1
        self._sum_nodes(wait=False)

    def _sum_nodes(self, wait: bool) -> None:
        """The node's sums of the shared buckets this rank is the node owner of, in bucket order,
        as their counts are in (waiting for each when `wait`); on several nodes, each sum then
        reduced over the node owners into the bucket's owner."""
        while self._summing:
            b, work = self._summing[0]
            if not (wait or work.is_completed()):
                return
            work.wait()
            self._summing.popleft()
            b.sum_gradients()
            owner, peers = _global_rank(self.group, b.owner), b.nodes.peers
            if peers is None:  # one node: its sum is the job's
                self._works[b.serial] = work
                continue
            work = dist.reduce(b.buffers.grad_ext, dst=owner, group=peers, async_op=True)
            self.moved += _nbytes(b.buffers.grad_ext)
            if owner == dist.get_rank():
                self._works[b.serial] = work
            else:
                self._sent.append(work)

    def reduced(self, owned, wait: bool) -> Iterator:
        """Of this rank's buckets `owned`, those whose reduce has finished (waiting for each when
        `wait`), once each, averaged, with `has` saying which parameters any rank had a gradient
        for. First the node sums this rank forms (_sum_nodes), for its own buckets and others'."""
        self._sum_nodes(wait)
        for b in owned:
            work = self._works.get(b.serial)
            if work is None or not (wait or work.is_completed()):
                continue
            work.wait()
            del self._works[b.serial]
            b.this_step.has = [bool(x > 0) for x in b.buffers.grad_ext[b.numel:].tolist()]
            b.buffers.grad.div_(self.world)
            yield b

    def gather_norms(self, keyed: List[Tuple[int, torch.Tensor]]) -> List:
        """Every rank's (key, per-parameter norm) pairs, from this rank's: the parameters of its
        buckets. A few bytes a parameter, so that the global norm is formed as one process forms
        it (each rank the same, in the same order)."""
        mine = [(k, n.item(), n.dtype) for k, n in keyed]  # a float holds any norm's value
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        return [(k, torch.tensor(n, dtype=dtype)) for pairs in every for k, n, dtype in pairs]

    # ---- weights ----

    def writes_next(self, b) -> bool:
        """Whether this rank's `out` of bucket b receives its new weights: every rank's, or of a
        bucket the node's ranks share, the owner's and the node owners' (their node's next
        version)."""
        nodes = b.nodes
        return nodes is None or nodes.node_owner(_global_rank(self.group, b.owner)) == \
            dist.get_rank()

    def broadcast_weights(self, buckets, stepped) -> List:
        """Every bucket's new weights (its `out` buffer, with the flags its owner stepped each
        parameter with) from its owner to every rank; returns (bucket, flags) of the buckets whose
        owner stepped them. A bucket the node's ranks share (b.nodes) has its owner make its
        node's next version whole, the other nodes' node owners receive it into theirs, and each
        node owner then sends its node the flags alone: every rank may flip once they arrive."""
        for b in buckets:  # the flags into the owner's `out`
            if b.owner == self.rank:
                launched = any(b is s for s in stepped)
                flags = [b.flags[i] if launched else 0 for i in range(len(b.sizes))]
                if b.nodes is not None and any(flags):
                    b.finish_next(flags)
                b.buffers.out_ext[b.numel:] = torch.tensor([float(f) for f in flags])
        across = {}  # shared buckets' weights to the other nodes first, all issued at once
        for b in buckets:
            nodes = b.nodes
            if nodes is not None and nodes.peers is not None and self.writes_next(b):
                across[b.serial] = dist.broadcast(b.buffers.out_ext,
                                                  src=_global_rank(self.group, b.owner),
                                                  group=nodes.peers, async_op=True)
                self.moved += _nbytes(b.buffers.out_ext)
        works, messages = [], []
        for b in buckets:
            nodes = b.nodes
            if nodes is None:
                messages.append(b.buffers.out_ext[b.numel:])
                works.append(dist.broadcast(b.buffers.out_ext,
                                            src=_global_rank(self.group, b.owner),
                                            group=self.group, async_op=True))
                self.moved += _nbytes(b.buffers.out_ext)
                continue
            message = torch.zeros(len(b.sizes))
            if self.writes_next(b):
                if b.serial in across:
                    across.pop(b.serial).wait()
                message.copy_(b.buffers.out_ext[b.numel:])
            messages.append(message)
            works.append(dist.broadcast(
                message, src=nodes.node_owner(_global_rank(self.group, b.owner)),
                group=nodes.group, async_op=True))
            self.moved += _nbytes(message)
        for w in works:
            w.wait()
        out = []
        for b, message in zip(buckets, messages):
            flags = [int(x) for x in message.tolist()]
            if any(flags):
                out.append((b, flags))
        return out

    def share_params(self, buckets) -> None:
        """Every bucket's parameters as its owner has them (after a resume, or when the ranks
        began from different weights). A bucket the node's ranks share: to each node's copy,
        through its node owner."""
        for b in buckets:
            nodes, owner = b.nodes, _global_rank(self.group, b.owner)
            if b.numel == 0 or (nodes is not None and (nodes.peers is None
                                                      or not self.writes_next(b))):
                continue
            flat = torch.cat([b.weight(i) for i in range(len(b.sizes))])
            dist.broadcast(flat, src=owner, group=self.group if nodes is None else nodes.peers)
            if b.owner != self.rank:
                b.set_weights(flat)
        if any(b.nodes is not None and b.nodes.peers is not None for b in buckets):
            self.barrier()  # the node's other ranks read its copy once it is written

    FROZEN_BATCH_BYTES = 64 << 20  # a frozen base is broadcast this much at a time

    def share_frozen(self, params) -> None:
        """Frozen parameters, which have no bucket (no state), as the group's first rank has
        them, as share_params gives each bucket's: the ranks may have begun from different
        weights. Broadcast in batches of one dtype and at most FROZEN_BATCH_BYTES (or one
        parameter), so that a large frozen base is never copied whole into host memory."""
        batches: List[List[torch.Tensor]] = []
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in params:
            if not p.numel():
                continue
            batch = by_dtype.get(p.dtype)
            nbytes = p.numel() * p.element_size()
            if batch is None or sum(q.numel() * q.element_size() for q in batch) + nbytes > \
                    self.FROZEN_BATCH_BYTES:
                batch = by_dtype[p.dtype] = []
                batches.append(batch)
            batch.append(p)
        for ps in batches:
            flat = torch.cat([p.detach().reshape(-1).to("cpu") for p in ps])
            dist.broadcast(flat, src=_global_rank(self.group, 0), group=self.group)
            if self.rank == 0:
                continue
            offset = 0
            with torch.no_grad():
                for p in ps:
                    p.copy_(flat[offset:offset + p.numel()].view(p.shape))
                    offset += p.numel()

    def take_moved(self) -> int:
        """The bytes of gradients, counts and weights this rank sent or received through
        torch.distributed since the last call (each collective's buffer, once)."""
        moved, self.moved = self.moved, 0
        return moved

    def end_step(self) -> None:
        # The reduces into other ranks read this rank's buffers until done; and an abandoned
        # step: let what was issued finish.
        for work in [*self._sent, *self._works.values(), *(w for _, w in self._summing)]:
            work.wait()
        self._works.clear()
        self._sent.clear()
        self._summing.clear()
        self._next = 0
        self.early = 0
