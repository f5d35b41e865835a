"""One set of weights for a job's ranks on a node (docs/streaming.md, "A job's ranks on one node").

stream_parameters(..., share_ranks=True), torch.distributed initialised on every rank: the ranks
of the job on one node (one daemon) stream one set of weight chunks, each unit's two versions,
instead of one set each. They sit in a shared base that the job's sessions write (the daemon's
job-writable base, named after the stream): the node's first rank makes it and writes the
weights, the others open it, every rank of the node maps the same memory. OffloadedAdamW sharded
over the ranks (ZeRO-1) has each bucket's owner step it into the shared next version and tells
the other ranks only which parameters it stepped; every rank flips the version at that
collective, so the node's copy is the last complete step's whatever fails after it.

Each rank's gradients stay in the node's memory (a gradient chunk per rank and unit in the base),
where one rank of the node sums them. On several nodes, a bucket's node owner on each node (the
rank with its owner's local index: Nodes) sums the node's, only those sums travel between nodes
(to the owner), and the owner's new weights travel back to the node owners alone.

The sessions must declare the job ($TIERD_JOB, the same on every rank): the daemon lets only the
job's sessions of the same user open and write the base, and frees it when the last one ends.
"""
import json
import re
import socket
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from .._errors import InvalidArgument
from .._abi import Status
from ..client import Access, Client, Tier, TierdError
from ._agree import all_succeeded
from ._held_base import HeldBase
from ._shared_base import canonical
from ._storage import as_tensor
from ._units import Units

FORMAT = "tierd.ranks/1"


class SharedIds:
    """A unit's two version chunks in the job's base: the chunk ids, freed with the base."""

    def __init__(self, ids: List[int]):
        self.ids = ids

    def free_deferred(self) -> None:
        pass  # the base's: it goes with its last holder


class Nodes:
    """The job's ranks by node (the ranks of one daemon), and the gloo groups a shared bucket's
    gradients and new weights travel in: this node's ranks (group), and the ranks of this rank's
    local index on every node (peers; None on one node). Every node has as many ranks."""

    def __init__(self, rank: int, node_of: List[Any]):
        order = list(dict.fromkeys(node_of))  # the nodes, by their first rank
        members = [[r for r, n in enumerate(node_of) if n == node] for node in order]
        if len({len(m) for m in members}) != 1:
            counts = ", ".join(f"{len(m)} on {n[0]}:{n[1]}" for m, n in zip(members, order))
            raise InvalidArgument("stream_parameters: share_ranks on several nodes needs as many "
                                  f"ranks on every node (here {counts})")
        self.count = len(members)
        self.per_node = len(members[0])
        self.local = members[order.index(node_of[rank])]  # this node's ranks
        self.index = self.local.index(rank)               # this rank's among them
        self._index = {r: k for m in members for k, r in enumerate(m)}
        # new_group is a collective of every rank, for every group, in the same order.
        self.group = self.peers = None
        for m in members:
            g = dist.new_group(ranks=m, backend="gloo")
            self.group = g if rank in m else self.group
        if self.count > 1:
            for k in range(self.per_node):
                g = dist.new_group(ranks=[m[k] for m in members], backend="gloo")
                self.peers = g if k == self.index else self.peers

    def node_owner(self, owner: int) -> int:
        """The rank of this node that sums a bucket of `owner` (a global rank) over the node and
        receives its new weights: the one with the owner's local index (the owner, on its own
        node)."""
        return self.local[self._index[owner]]


class RankWeights:
    """The job's base on this node: who makes it (the node's first rank), made or opened."""

    def __init__(self, client: Client, name: str, units: Units, names: Dict[int, List[str]]):
        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgument("stream_parameters: share_ranks=True needs torch.distributed "
                                  "initialised on every rank")
        self.client = client
        self.name = "ranks/" + re.sub(r"[^A-Za-z0-9._\-@:]", "_", name)
        self.units = units
        self.group = dist.new_group(backend="gloo")  # every rank makes it, at the same point
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # The ranks on this node: those whose sessions are with this daemon (its host and socket
        # directory: two daemons on one machine stand for two nodes).
        node_of = [None] * self.world
        dist.all_gather_object(node_of, (socket.gethostname(), client.socket_dir),
                               group=self.group)
        self.nodes = Nodes(self.rank, node_of)
        self.leader = self.nodes.index == 0
        # The gradients are summed where the ranks' backward left them: a gradient chunk per
        # rank of the node and unit in the base, this rank's the one of its local index.
        self.slabs = self.nodes.per_node
        self.slab = self.nodes.index
        self.base = HeldBase(client, self.name)
        self.descriptor = json.dumps({
            "format": FORMAT, "world": self.world, "ranks_on_node": self.slabs,
            "units": [{"unit": u.name, "bytes": u.chunk_bytes,
                       "params": [[canonical(names[id(p)][0]), str(p.dtype), list(p.shape)]
                                  for p in u.params]} for u in units]}, sort_keys=True)

    def make(self) -> None:
        """The node's first rank: makes the base (each unit's two versions, at home where
        Units.place put them) and gives the units its chunks, to be written and sealed."""
        sizes, homes = [], []
        per_unit = 2 + self.slabs
        for u in self.units:
            sizes += [u.chunk_bytes] * per_unit
            homes += [u.home] * per_unit
        try:
            opened = self.base.make(sizes, homes, self.descriptor.encode(), job_writable=True)
        except TierdError as e:
            if e.code == Status.INVALID_ARGUMENT and "job" in str(e):
                raise InvalidArgument("stream_parameters: share_ranks=True needs the ranks' "
                                      "sessions to declare their job: set TIERD_JOB, the same on "
                                      f"every rank ({e})") from None
            if e.code == Status.ALREADY_EXISTS:
                raise InvalidArgument(f"stream_parameters: a base named {self.name!r} is in use on "
                                      "this node (another job, or a run of this one with another "
                                      "model or number of ranks): give the stream another name=")
            raise
        if not opened.created:
            raise InvalidArgument(f"stream_parameters: the ranks' base {self.name!r} exists "
                                  "already (a job of this name runs on this node): give the "
                                  "stream another name=")
        self._take(opened)

    def seal(self) -> None:
        self.client.seal_base(self.name)

    def open(self, wait_s: float = 600.0) -> None:
        """The node's other ranks, once its first rank sealed the base: open it and check that
        it is this job's model on as many ranks."""
        opened = self.base.open(wait_s, 0.05)
        if opened.descriptor != self.descriptor.encode():
            theirs = json.loads(opened.descriptor.decode())
            what = (f"{theirs.get('world')} ranks, here {self.world}"
                    if theirs.get("world") != self.world else "another model's layout")
            raise InvalidArgument(f"stream_parameters: the ranks' base {self.name!r} was made for "
                                  f"{what}: every rank of the job streams the same model")
        self._take(opened)

    def _take(self, opened) -> None:
        per_unit = 2 + self.slabs
        for k, u in enumerate(self.units):
            ids = opened.ids[per_unit * k:per_unit * k + 2]
            u.home = opened.homes[per_unit * k]
            u.chunks = SharedIds(ids)
            u.grad_slabs = opened.ids[per_unit * k + 2:per_unit * (k + 1)]
            u.slab = self.slab
            if u.home == Tier.HOST:
                u.held = self.client.acquire(ids, Tier.HOST, Access.WRITE)
                for v in (0, 1):
                    u.views[v] = as_tensor(u.held, v, torch.uint8, [u.chunk_bytes])

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def agree(self, doing: str, error) -> None:
        """Raises on every rank when one failed `doing`, naming it (_agree.all_succeeded)."""
        all_succeeded(self.group, "stream_parameters", doing, error)

    def release(self) -> None:
        self.base.release()
