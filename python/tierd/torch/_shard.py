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
"""
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

from ._agree import all_succeeded


def _global_rank(group, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    convert = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return convert(group, rank)


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
            raise ValueError("OffloadedAdamW: process_group must span every rank (each rank "
                             "owns a share of the state and all take part in every step)")
        if dist.get_world_size() == 1:
            return None
        return Comm(process_group)

    def __init__(self, process_group):
        backend = str(dist.get_backend(process_group))
        # Made by every rank at the same point (all of them construct the optimizer).
        self.group = process_group if "gloo" in backend else dist.new_group(backend="gloo")
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._next = 0       # the next bucket whose reduce is to be issued this step
        self._works = {}     # bucket index -> its reduce in flight
        self.early = 0       # reduces issued during this step's backward

    def assign(self, buckets, existing) -> None:
        """Sets each new bucket's owner (balanced by parameters with the `existing` ones, the same
        on every rank) and the owned ones' slots in the order given (b.slot: 0, 1, ... here, the
        caller moves them after its own; None for others' buckets)."""
        if not existing and len(buckets) < self.world:
            raise ValueError(f"OffloadedAdamW: {len(buckets)} buckets cannot be shared by "
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
            raise RuntimeError(f"OffloadedAdamW: the ranks' shards disagree on {what} (from "
                               f"{-int(mine[1])} to {int(mine[0])}): resume every rank's state "
                               "from the same run, with the same number of ranks")

    # ---- gradients ----

    def reduce_ready(self, buckets, force: bool = False) -> None:
        """Issues the reduces of the complete buckets in bucket order from the next one (all the
        rest when `force`: the gradients of every bucket not yet issued are in place)."""
        while self._next < len(buckets):
            b = buckets[self._next]
            if not force and not b.complete:
                return
            self.early += 0 if force else 1
            if b.event is not None:
                b.event.synchronize()
            b.need_grad()
            b.grad_ext[b.numel:] = torch.tensor([1.0 if g else 0.0 for g in b.got])
            # A bucket the node's ranks share sends the counts alone: its owner reads the
            # gradients where each rank left them (sum_gradients) once the counts are in.
            message = b.grad_ext[b.numel:] if b.shared else b.grad_ext
            self._works[b.serial] = dist.reduce(message, dst=_global_rank(self.group, b.owner),
                                                group=self.group, async_op=True)
            self._next += 1

    def reduced(self, owned, wait: bool) -> Iterator:
        """Of this rank's buckets `owned`, those whose reduce has finished (waiting for each when
        `wait`), once each, averaged, with `has` saying which parameters any rank had a gradient
        for."""
        for b in owned:
            work = self._works.get(b.serial)
            if work is None or not (wait or work.is_completed()):
                continue
            work.wait()
            del self._works[b.serial]
            b.has = [bool(x > 0) for x in b.grad_ext[b.numel:].tolist()]
            if b.shared:
                b.sum_gradients()
            b.grad.div_(self.world)
            yield b

    def grad_norm(self, norms: List[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm over every rank's gradients, from this rank's per-parameter norms."""
        squares = torch.zeros((), dtype=torch.float64)
        if norms:
            squares = torch.stack(norms).double().square().sum()
        dist.all_reduce(squares, group=self.group)
        return squares.sqrt().float()

    # ---- weights ----

    def broadcast_weights(self, buckets, stepped) -> List:
        """Every bucket's new weights (its `out` buffer, with the flags its owner stepped each
        parameter with) from its owner to every rank; returns (bucket, flags) of the buckets whose
        owner stepped them. A bucket the node's ranks share (b.shared) sends its flags alone:
        its owner wrote the shared next version, made whole before the flags leave, so every
        rank may flip it once they arrive."""
        works, messages = [], []
        for b in buckets:
            message = b.out_ext[b.numel:] if not b.shared else torch.zeros(len(b.sizes))
            if b.owner == self.rank:
                launched = any(b is s for s in stepped)
                flags = [b.flags[i] if launched else 0 for i in range(len(b.sizes))]
                if b.shared and any(flags):
                    b.finish_next(flags)
                message.copy_(torch.tensor([float(f) for f in flags]))
            messages.append(message)
            works.append(dist.broadcast(b.out_ext if not b.shared else message,
                                        src=_global_rank(self.group, b.owner),
                                        group=self.group, async_op=True))
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
        began from different weights)."""
        for b in buckets:
            if b.numel == 0 or b.shared:  # the ranks of the node read the same weights
                continue
            flat = torch.cat([b.weight(i) for i in range(len(b.sizes))])
            dist.broadcast(flat, src=_global_rank(self.group, b.owner), group=self.group)
            if b.owner != self.rank:
                b.set_weights(flat)

    def end_step(self) -> None:
        for work in self._works.values():  # an abandoned step: let what was issued finish
            work.wait()
        self._works.clear()
        self._next = 0
        self.early = 0
