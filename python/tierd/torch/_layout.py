"""OffloadedAdamW's buckets as its parameter groups are now: made at construction, and followed
between steps as torch lets the groups change (add_param_group, params lists edited, a
parameter's dtype or device changed), each parameter's place (bucket, slot) kept.

A parameter that leaves the groups keeps its slot and state, as torch keeps `state[p]`; a bucket
whose slots all left is dormant, and its state goes once none of its parameters lives.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._errors import FailedPrecondition, InvalidArgument
from ._buckets import Bucket, StreamBucket, check_dtype, plan
from ._shard import Comm
from ._state import OptimizerState
from ._ranges import parts_of

Groups = Callable[[], List[Dict[str, Any]]]


class BucketLayout:
    def __init__(self, groups: Groups, bucket_params: int, comm: Optional[Comm]):
        self._groups = groups  # the optimizer's param_groups, as they are now
        self._bucket_params = bucket_params
        self._comm = comm
        self.buckets = plan(self._wanted(), bucket_params, 0)
        if comm is not None:
            comm.assign(self.buckets, [])
        else:
            for j, b in enumerate(self.buckets):
                b.slot = j
        self.owned = [b for b in self.buckets if b.slot is not None]  # this rank's, by slot
        # Every parameter's place: id -> (bucket, slot); the layout of the groups it reflects.
        self.where: Dict[int, Tuple[Bucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self.where[id(p)] = (b, i)
        self._signature = self.signature()

    def _wanted(self) -> List[Tuple[int, Dict[str, Any], torch.Tensor]]:
        """(group index, group, parameter) for every parameter in the groups, checked as
        torch.optim checks them, but those frozen that have no place yet: as torch makes a
        parameter's state at its first step with a gradient, a frozen one gets none (a LoRA
        job's base costs no state) until it requires a gradient."""
        seen = set()
        out = []
        placed = getattr(self, "where", {})
        for gi, g in enumerate(self._groups()):
            for p in g["params"]:
                if id(p) in seen:
                    raise InvalidArgument("some parameters appear in more than one parameter group")
                seen.add(id(p))
                check_dtype(p)
                if p.requires_grad or id(p) in placed:
                    out.append((gi, g, p))
        return out

    def frozen(self) -> List[torch.Tensor]:
        """The parameters in the groups that have no place, being frozen (streamed ones left
        out: their weights are the stream's)."""
        return [p for g in self._groups() for p in g["params"]
                if id(p) not in self.where and not p.requires_grad and parts_of(p) is None]

    def streamed_bytes(self) -> int:
        """The weights of the streamed parameters placed, every rank's: a rank's stream holds
        them all."""
        return sum(b.numel * b.dtype.itemsize for b in self.buckets
                   if isinstance(b, StreamBucket))

    def signature(self):
        """The groups as the buckets follow them: each parameter, and whether it is frozen."""
        return tuple((id(g), tuple((id(p), p.requires_grad) for p in g["params"]))
                     for g in self._groups())

    def changed(self) -> bool:
        """Whether the groups changed since the buckets last followed them."""
        return self.signature() != self._signature

    def active(self) -> List[Bucket]:
        """The buckets with a parameter in the groups, in the order they were made."""
        return [b for b in self.buckets if b.active]

    def place(self, key: int) -> Optional[Tuple[Bucket, int]]:
        """The live place of the parameter of id `key`, if it has one."""
        place = self.where.get(key)
        if place is None:
            return None
        b, i = place
        if not b.active or not b.live[i] or id(b.params[i]) != key:
            return None
        return place

    # ---- following the groups ----

    def sync(self, state: OptimizerState) -> None:
        """Makes the buckets follow the parameter groups and frees the state of parameters that
        are gone. Between steps only."""
        if self.changed():
            self._relayout(state)
        dead = [b for b in self.buckets if self._dead(b)]
        if dead:
            self._remove(dead, state)

    def _dead(self, b: Bucket) -> bool:
        """Dormant, and no slot is the place of a parameter still alive (each is gone, or was
        moved to another bucket): its state can go."""
        if b.params is not None:
            return False
        for i in range(len(b.sizes)):
            p = b.param(i)
            if p is not None and self.where.get(id(p)) == (b, i):
                return False
        return True

    def _relayout(self, state: OptimizerState) -> None:
        keep, moves = [], []
        for gi, g, p in self._wanted():
            place = self.where.get(id(p))
            b, i = place if place is not None else (None, None)
            if b is not None and b.param(i) is not p:
                b = None  # an id reused by another tensor
            if b is not None and b.sizes[i] != p.numel():
                raise InvalidArgument(f"OffloadedAdamW: a parameter of {b.sizes[i]} elements now "
                                      f"has {p.numel()}; its state cannot follow a change of shape")
            if b is not None and b.group is g and b.dtype == p.dtype and b.device == p.device:
                keep.append((b, i))
            else:
                moves.append((gi, g, p, b, i))
        if any(parts_of(m[2]) is not None for m in moves):
            raise InvalidArgument("OffloadedAdamW: a streamed parameter (stream_parameters) "
                                  "joined (added, or unfrozen: a frozen one is given no state) or "
                                  "moved between parameter groups after the optimizer was made: "
                                  "give the constructor every streamed parameter to train, in its "
                                  "final group")
        carried = [m for m in moves if m[3] is not None]
        if carried and self._comm is not None:
            raise FailedPrecondition("OffloadedAdamW: sharded over ranks, a parameter with state "
                                     "cannot move to another parameter group, dtype or device (its "
                                     "state would change owner); add new parameters only")
        moved, read = {}, {}
        for _, _, p, b, i in carried:  # read before anything changes
            moved[id(p)] = state.state_of(b, i, read)
        for b in self.buckets:
            b.live = [False] * len(b.sizes)
        for b, i in keep:
            b.wake()
            b.live[i] = True
        new = plan([(gi, g, p) for gi, g, p, _, _ in moves], self._bucket_params,
                   1 + max((b.serial for b in self.buckets), default=-1))
        if new:
            self._add(new, moved, state)
        for b in self.buckets:
            if b.params is not None and not any(b.live):
                b.go_dormant()
        self._signature = self.signature()

    def _add(self, new: List[Bucket], moved: Dict[int, Dict[str, Any]],
             state: OptimizerState) -> None:
        if self._comm is not None:
            self._comm.assign(new, self.active())
        else:
            for b in new:
                b.slot = 0  # renumbered below
        owned = [b for b in new if b.slot is not None]
        for j, b in enumerate(owned):
            b.slot = len(self.owned) + j
        state.add_groups(owned)
        self.owned += owned
        self.buckets += new
        for b in new:
            for i, p in enumerate(b.params):
                self.where[id(p)] = (b, i)
        state.initialize(owned, moved)
        if self._comm is not None:
            self._comm.share_params(new)
        for b in new:
            b.mirror()

    def _remove(self, buckets: List[Bucket], state: OptimizerState) -> None:
        """Frees the state of `buckets` (dormant, their parameters gone)."""
        owned = [b for b in buckets if b.slot is not None]
        if owned:
            state.adam.remove_groups([b.slot for b in owned])
        gone = set(id(b) for b in buckets)
        self.buckets = [b for b in self.buckets if id(b) not in gone]
        self.owned = [b for b in self.owned if id(b) not in gone]
        for j, b in enumerate(self.owned):
            b.slot = j
        self.where = {k: v for k, v in self.where.items() if id(v[0]) not in gone}

    def owned_shapes(self) -> Dict[int, Tuple[int, ...]]:
        """The state_dict indices of the parameters this rank owns (all of them unsharded), with
        their shapes."""
        index = {}
        for g in self._groups():
            for p in g["params"]:
                index.setdefault(id(p), len(index))
        return {index[id(p)]: tuple(p.shape) for b in self.owned
                for i, p in enumerate(b.params) if b.live[i] and id(p) in index}
