"""A shared base: the frozen parameters of a stream's units, one read-only copy for every job on
the node (docs/streaming.md, "One copy per node").

stream_parameters(..., shared_base=NAME) puts every streamed parameter, frozen, in one chunk per
unit of the daemon's shared base NAME: the base of LoRA fine-tuning (peft's adapters, added after,
are the job's own and stay on the device), a model evaluated. The first job to ask makes the base:
it lays the chunks out, writes the weights from its source (a checkpoint, or the model's own), and
seals it; every later job opens the same chunks, which its session maps read-only. The daemon
counts the base once, charges it to its maker, and frees it when its last holder goes (a job that
dies lets go of its hold) unless it is pinned.

What the base holds is written down in its descriptor, which the daemon keeps for its maker: the
layout (each unit's parameters by name, dtype, shape and offset), where the weights came from (a
checkpoint's digest, or the model's own weights) and a SHA-256 of the bytes written. A job that
opens it checks the layout, the checkpoint's digest (its layout and a sample of every tensor's
bytes: a quick first refusal), and then the SHA-256 of every byte its own source would have
written against the maker's: a job never trains on other weights than its own under the same
name, however little they differ. A checkpoint's bytes are hashed in the background while the
job starts, and waited for before its first optimizer step or output (_base_check.py); a model's
own weights at once, before the stream points them elsewhere. The descriptor is the maker's word,
so a base is opened only when its maker is trusted: this user, root, or a user named in
trust_base_makers (a group member could otherwise publish other bytes under a copied
descriptor). A model built on the meta device
gives the checkpoint all the same: the weights outside the units (embeddings, head, norms) are the
job's own, on its device, and come from there.
"""
import hashlib
import json
import logging
import os
import pwd
from typing import Dict, List, Optional, Sequence, Union

import torch

from .._errors import InvalidArgument, PermissionDenied
from .._abi import Status
from ..client import Access, Client, Tier, TierdError
from .._sizes import size_text
from ._base_check import BaseCheck, Value, contents
from ._held_base import HeldBase
from ._progress import bar
from ._storage import as_tensor, range_view
from ._units import ALIGN, BASE, Range, Units, align, by_dtype, fill

FORMAT = "tierd.base/1"

log = logging.getLogger(__name__)


def canonical(name: str) -> str:
    """A parameter's name as the base records it: the model's own, before peft wrapped it (its
    "base_model.model." prefix and a LoRA layer's "base_layer." dropped), so that a job with
    adapters and one without share a base."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


class BaseChunk:
    """One unit's chunk of the base: its id, size and home tier, held in host memory for good
    when it is at home there."""

    def __init__(self, chunk_id: int, nbytes: int, home: Tier):
        self.id = chunk_id
        self.nbytes = nbytes
        self.home = home
        self.held = None  # the read hold of a host-homed chunk

    def let_go(self) -> None:
        if self.held is not None:
            self.held.release_deferred()
            self.held = None


class SharedBase:
    """A stream's part in one shared base: the plan of its chunks, and opening or making it."""

    def __init__(self, client: Client, name: str, units: Units, names: Dict[int, List[str]],
                 group: Optional[int], wait_s: float, trusted: Sequence[Union[int, str]] = (),
                 progress: Optional[bool] = None):
        self.client = client
        self.progress = progress  # a bar while this job fills the base (_progress.py)
        self.name = name
        self.units = units
        self.group = group
        self.wait_s = wait_s
        self.trusted = {os.getuid(), 0} | {_uid(who) for who in trusted}
        self.base = HeldBase(client, name)
        self.check: Optional[BaseCheck] = None  # an opener's check of its checkpoint, running
        # Each unit's frozen parameters, as ranges of its chunk in the base (by index).
        self.plan: Dict[int, List[Range]] = {}
        self.bytes: Dict[int, int] = {}
        layout = []
        for u in units:
            frozen = list(u.params)
            for p in frozen:
                p.requires_grad_(False)
            ranges, offset = [], 0
            for group_params in by_dtype(frozen):
                if not group_params:
                    continue
                r = Range(group_params, 0)
                r.in_base = True
                r.current = BASE
                r.offset = offset
                offset += align(r.nbytes)
                ranges.append(r)
            self.plan[u.index] = ranges
            u.base_ranges = ranges  # its own chunks hold none of them
            self.bytes[u.index] = max(offset, ALIGN)
            layout.append({"unit": u.name, "bytes": self.bytes[u.index], "params": [
                [canonical(names[id(p)][0]), str(p.dtype), list(p.shape),
                 r.offset + o * p.element_size()]
                for r in ranges for p, o in zip(r.params, r.offsets)]})
        self.layout = layout

    # ---- open or make ----

    def attach(self, source, homes: Dict[int, Tier]) -> None:
        """Opens the base, or makes it from `source` (at home where `homes` says, by unit index)
        when there is none; then gives each unit its chunk and ranges there. Raises, having let
        the base go, when the base holds another layout or other weights than this job's; an
        opener's checkpoint is checked in full in the background, steps and outputs waiting for
        it (_base_check.py)."""
        identity = source.identity()
        if identity["kind"] == "init":
            raise InvalidArgument(f"stream_parameters: shared_base={self.name!r} with a model on "
                                  "the meta device needs checkpoint=: the base holds the streamed "
                                  "units, and the weights outside them (embeddings, head, norms) "
                                  "come from the checkpoint")
        order = sorted(self.plan)
        # Waits while another job loads it; made here when there is none (None: another job
        # made it meanwhile, and it is opened).
        opened = self.base.open(self.wait_s, 0.2,
                                make=lambda: self._make(source, identity, order, homes))
        try:
            if not opened.created:
                self._check_maker(opened.creator_uid)
                self._check(opened.descriptor, source, identity)
                if self.check is not None:
                    self.check.gate([u.module for u in self.units])
                log.info("shared base %r opened: made by uid %d, %s", self.name,
                         opened.creator_uid, size_text(sum(opened.sizes)))
            if len(opened.ids) != len(order):
                raise InvalidArgument(f"shared base {self.name!r} has {len(opened.ids)} chunks; "
                                      f"this model's frozen units need {len(order)}")
            for index, chunk_id, size, home in zip(order, opened.ids, opened.sizes, opened.homes):
                u = self.units[index]
                u.base = BaseChunk(chunk_id, size, home)
                u.base_ranges = self.plan[index]
                if home == Tier.HOST:
                    u.base.held = self.client.acquire([chunk_id], Tier.HOST, Access.READ)
                    u.views[BASE] = as_tensor(u.base.held, 0, torch.uint8, [size])
        except BaseException:
            self.release()
            raise

    def _make(self, source, identity, order: List[int], homes: Dict[int, Tier]):
        """Makes, fills and seals the base; None when another job made it (or makes it) first.
        One unit's weights in the process at a time; the descriptor it is sealed with records
        the SHA-256 of what was written."""
        sizes = [self.bytes[i] for i in order]
        try:
            opened = self.base.make(sizes, [homes[i] for i in order],
                                    self._descriptor(identity, None).encode(), self.group)
        except TierdError as e:
            if e.code in (Status.ALREADY_EXISTS, Status.UNAVAILABLE):
                return None
            raise
        if not opened.created:
            return opened
        try:
            hashed = hashlib.sha256()
            written = []
            with bar(f"Filling shared base {self.name}", sum(sizes), self.progress) as done:
                for k, index in enumerate(order):
                    self._fill_one(source, opened, k, index, sizes[k], hashed, written)
                    done(sizes[k])
            for w in written:
                w.wait()
            descriptor = self._descriptor(identity, hashed.hexdigest()).encode()
            self.client.seal_base(self.name, descriptor)
        except BaseException:
            self.base.release()  # abandoned: the daemon frees it
            raise
        opened.descriptor = descriptor
        return opened

    def _fill_one(self, source, opened, k: int, index: int, size: int, hashed,
                  written: List) -> None:
        """Writes unit `index`'s frozen weights into the base's chunk k, hashing what was
        written; an NVMe chunk's write-down is started (its completion added to `written`)."""
        params = [p for r in self.plan[index] for p in r.params]
        values = source.unit_values(self.units[index].module, params)
        with self.client.acquire([opened.ids[k]], Tier.HOST, Access.OVERWRITE) as held:
            view = as_tensor(held, 0, torch.uint8, [size])
            fill(self.client, opened.ids[k], view, self.plan[index], values)
            for r in self.plan[index]:  # what was written, in order
                dst = range_view(view, r)
                for i in range(len(r.params)):
                    hashed.update(r.slice(dst, i).view(torch.uint8).numpy().data)
                del dst
            del view
        if opened.homes[k] == Tier.NVME:  # written down now, as a stream's own units
            written.append(self.client.evict([opened.ids[k]], Tier.NVME))

    def _descriptor(self, identity: Dict[str, str], hashed: Optional[str]) -> str:
        return json.dumps({"format": FORMAT, "layout": self.layout, "source": identity,
                           "contents": hashed}, sort_keys=True)

    # ---- what an opener checks ----

    def _check(self, descriptor: bytes, source, identity: Dict[str, str]) -> None:
        try:
            theirs = json.loads(descriptor.decode())
        except ValueError:
            theirs = {}
        if theirs.get("format") != FORMAT:
            raise InvalidArgument(f"shared base {self.name!r} was not made by a tierd stream of "
                                  "this version")
        if theirs["layout"] != self.layout:
            raise InvalidArgument(f"shared base {self.name!r} holds another model's layout: "
                                  f"{_first_difference(theirs['layout'], self.layout)}; open it "
                                  "with the model it was made from, with the same parameters "
                                  "frozen")
        if theirs.get("contents") is None:
            raise InvalidArgument(f"shared base {self.name!r} was sealed without a record of its "
                                  "contents")
        if identity["kind"] == "checkpoint":
            if theirs["source"] != identity:
                raise InvalidArgument(f"shared base {self.name!r} was made from "
                                      f"{_source_text(theirs['source'])}, not from this checkpoint "
                                      f"(layout digest {identity['digest'][:16]}...)")
            twin = source.duplicate()  # read by the check while the job's own is closed
            try:
                values = self._values(twin)
            except BaseException:
                twin.close()
                raise
            self.check = BaseCheck(self.name, theirs["contents"], values, twin.close)
        elif contents(self._values(source)) != theirs["contents"]:
            raise InvalidArgument(f"shared base {self.name!r} holds other weights than this "
                                  "model's frozen parameters (another checkpoint or fine-tune "
                                  "under the same name): give the base another name")

    def _values(self, source) -> List[Value]:
        """What the source gives the base, in the order its maker hashed what it wrote."""
        out: List[Value] = []
        for index in sorted(self.plan):
            params = [p for r in self.plan[index] for p in r.params]
            values = source.unit_values(self.units[index].module, params)
            for p in params:
                v = values[id(p)]
                # A checkpoint's reader reads into a tensor of the model's dtype.
                out.append((p.numel(), p.dtype, v) if callable(v) else v)
        return out

    def checked(self) -> None:
        """Returns once this job's checkpoint is known to be the base's; raises ValueError when
        it is not."""
        if self.check is not None:
            self.check.wait()

    def _check_maker(self, creator_uid: int) -> None:
        if creator_uid in self.trusted:
            return
        try:
            who = f"{pwd.getpwuid(creator_uid).pw_name} (uid {creator_uid})"
        except KeyError:
            who = f"uid {creator_uid}"
        raise PermissionDenied(f"shared base {self.name!r} was made by {who}, whom this job does "
                               "not trust: its descriptor is that user's word for what it holds. "
                               "Give trust_base_makers=[...] naming that user to open it, or "
                               "another base name to make your own")

    def release(self) -> None:
        """Lets the base go (the daemon frees it with its last holder, unless it is pinned)."""
        if self.check is not None:
            self.check.close()
        for u in self.units:
            if u.base is not None:
                u.base.let_go()
                u.views.pop(BASE, None)
        self.base.release()


def _uid(who: Union[int, str]) -> int:
    if isinstance(who, int):
        return who
    try:
        return pwd.getpwnam(who).pw_uid
    except KeyError:
        raise InvalidArgument(f"trust_base_makers: no user {who!r} on this machine") from None


def _first_difference(theirs: list, ours: list) -> str:
    if len(theirs) != len(ours):
        return f"{len(theirs)} units with frozen parameters, this model {len(ours)}"
    for a, b in zip(theirs, ours):
        if a == b:
            continue
        if a["unit"] != b["unit"] or len(a["params"]) != len(b["params"]):
            return f"unit {a['unit']!r} ({len(a['params'])} parameters), here {b['unit']!r} " \
                   f"({len(b['params'])})"
        for x, y in zip(a["params"], b["params"]):
            if x != y:
                return f"{x[0]} {x[1]} {tuple(x[2])}, here {y[0]} {y[1]} {tuple(y[2])}"
    return "the chunk sizes"


def _source_text(source: Dict[str, str]) -> str:
    if source.get("kind") == "checkpoint":
        return f"a checkpoint of layout digest {source.get('digest', '?')[:16]}..."
    return "a model's own weights"
