"""Parameter streaming: a model whose weights do not fit on the device trains through a window.

    stream = tierd.torch.stream_parameters(model, device=torch.device("cuda"),
                                           device_budget_bytes=8 << 30)
    opt = tierd.torch.OffloadedAdamW(model.parameters(), lr=3e-4, overlap_backward=True)
    for x, y in data:
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

The model is cut into *units* (module subtrees; by default the blocks of its largest ModuleList).
Each unit's weights live in two daemon chunks, the unit's two *versions* (at home in the host tier
up to host_budget_bytes, on NVMe past it); on the device a unit's parameters keep their shape but
have an empty storage, except while the unit is in the *window*: fetched for its forward, again
for its backward, released after each. Everything outside the units stays on the device.

The rooms under this one are drawn in docs/architecture.md. Tensors autograd saved in forward
that view a parameter (a weight's transpose) view the unit's storage, so backward reads the
weights fetched for it.

OffloadedAdamW steps streamed parameters through one seam, _ranges.py, where the stream lends
its parts (_ranges.StreamParts): gradients leave the device into each range's gradient chunk, the
kernel writes the new weights into the range's next version, and StreamRange.commit makes it
current (the stream flips it: _seam.Seam.flipped); a step rolled back or skipped leaves the current
version as it was.
"""
import logging
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .._errors import FailedPrecondition, InvalidArgument
from ..client import Client, Tier, TierdError, connect
from .._sizes import size_text
from ._ddp import DDPIgnored
from ._stream_hooks import StreamHooks
from ._sources import FromCheckpoint, Init, placeholder, source_for, swap
from ._shared_base import SharedBase
from ._gather import Gathered, save_pretrained
from ._guard import guard, unguard
from ._loading import StateDictLoading
from ._ranges import StreamParts, parts_of, register
from ._figures import StreamFigures
from ._ranks import RankWeights
from ._seam import Seam
from ._trace import Trace
from ._units import Unit, Units, find_units
from ._window import Window

__all__ = ["ParameterStream", "stream_of", "stream_parameters"]

log = logging.getLogger(__name__)


def stream_of(p: torch.Tensor) -> Optional["ParameterStream"]:
    """The open stream that streams parameter p, if any."""
    parts = parts_of(p)
    return parts.owner() if parts is not None else None


class ParameterStream:
    """The hooks and the chunks of stream_parameters(); see the module's text."""

    def __init__(self, model: nn.Module, units: Optional[Sequence[nn.Module]] = None,
                 device: Optional[torch.device] = None, device_budget_bytes: int = 8 << 30,
                 prefetch: int = 1, host_budget_bytes: Optional[int] = None,
                 name: Optional[str] = None, client: Optional[Client] = None,
                 socket_dir: Optional[str] = None, checkpoint: Optional[str] = None,
                 init: Optional[Init] = None, shared_base: Optional[str] = None,
                 share_with_group: Optional[int] = None, base_wait_s: float = 3600.0,
                 trust_base_makers: Sequence[Any] = (),
                 share_ranks: bool = False, progress: Optional[bool] = None):
        self._parts: Optional[StreamParts] = None  # lent to the seam once set up: close() reads it
        device = torch.device(device if device is not None else "cuda")
        if prefetch < 0:
            raise InvalidArgument(f"prefetch must be >= 0, not {prefetch}")
        if host_budget_bytes is not None and host_budget_bytes < 0:
            raise InvalidArgument(f"host_budget_bytes must be >= 0, not {host_budget_bytes}")
        self.model = model
        self.device = device
        self.device_budget_bytes = int(device_budget_bytes)
        self.prefetch = int(prefetch)
        self.window_units = self.prefetch + 2  # on the device at once: ahead, computing, one more
        self.host_budget_bytes = host_budget_bytes
        self.name = name or type(model).__name__
        self.shared_base = shared_base
        self.progress = progress  # bars while weights are written in or saved (_progress.py)
        self._base = None
        self._ranks = None
        if share_ranks and shared_base is not None:
            raise InvalidArgument("stream_parameters: shared_base (a frozen base, read-only) and "
                                  "share_ranks (the ranks' weights, trained) do not go together")
        found = find_units(model, units)
        streamed = {id(p) for u in found for p in u.params}
        self._resident = _resident_tensors(model, streamed)
        self._check_budget(found)
        source = source_for(model, checkpoint, init)
        self.built_on_meta = source.built_on_meta
        try:
            source.check([p for u in found for p in u.params], self._resident)
            self._materialize(source, found)
            self._set_up(found, source, client, socket_dir, host_budget_bytes,
                         (shared_base, share_with_group, base_wait_s, trust_base_makers),
                         share_ranks)
        finally:
            source.close()

    def _materialize(self, source, found: List[Unit]) -> None:
        """The resident tensors made on the device; streamed parameters on meta replaced by
        placeholders on it (the units' storage is pointed at them as they are laid out)."""
        made = source.make_resident(self._resident, self.device)
        for u in found:
            for p in u.params:
                if p.is_meta:
                    made[id(p)] = placeholder(p, self.device)
        swap(self.model, made)
        source.follow(made)
        self._resident = [made.get(id(t), t) for t in self._resident]
        for u in found:
            u.params = [made.get(id(p), p) for p in u.params]

    def _set_up(self, found: List[Unit], source, client: Optional[Client],
                socket_dir: Optional[str], host_budget_bytes: Optional[int], base,
                share_ranks: bool) -> None:
        device = self.device

        self._own_client = client is None
        self._client = client if client is not None else connect(socket_dir, f"stream {self.name}")
        if device.type == "cuda":
            self._client.cuda_device()  # the daemon's host memory page-locked: copies are DMA
        has_nvme = self._client.tier_usage(Tier.NVME).configured
        self._figures = StreamFigures()
        self._nvme_start = self._client.path_bytes("nvme_to_host")
        self._units = Units(found, self._client, device)
        self._trace = Trace(self._units, self._figures)
        self._window = Window(self._units, self._trace, device, self.prefetch, self._figures)
        self._hooks = StreamHooks(self._units, self._window)
        self._loading = StateDictLoading(self._units, self._window, self._hooks.busy)
        self._ddp = DDPIgnored(self.model, (p for u in self._units for p in u.params))
        try:
            name, group, wait_s, trusted = base
            if name is not None:
                self._base = SharedBase(self._client, name, self._units, source.names.of, group,
                                        wait_s, trusted, self.progress)
            if share_ranks:
                self._ranks = RankWeights(self._client, self.name, self._units, source.names.of)
            self._units.place(host_budget_bytes, has_nvme,
                              self._base.bytes if self._base is not None else None,
                              allocate=self._ranks is None)
            if self._base is not None:
                self._base.attach(source, {u.index: u.home for u in self._units})
            self._window.add_resident(sum(t.numel() * t.element_size() for t in self._resident))
            seam = Seam(self._units, self._window, self._trace, self._ranks)
            self._parts = StreamParts(self._units, self._figures,
                                      self._ranks.nodes if self._ranks is not None else None,
                                      self.shared_base, seam.lay_out, seam.flipped, self)
            if self._ranks is None:
                self._lay_out_all(source, write=True)
            else:
                self._lay_out_ranks(source)
            source.wait_resident()  # read meanwhile (_sources.py)
            for u in self._units:
                register(u.params, self._parts)
                for p in u.params:
                    guard(p)  # outside the window, a use that reads it raises
            for installed in (self._hooks, self._loading, self._ddp):
                installed.install()
        except BaseException:
            self.close()
            raise
        on_nvme = sum(u.home == Tier.NVME for u in self._units)
        log.info("stream %r: %d units (the largest %s) through a window of %d on %s, %s "
                 "resident; %d units at home in the host tier, %d on NVMe%s", self.name,
                 len(self._units), size_text(self.largest_unit_bytes), self.window_units, device,
                 size_text(self.resident_bytes), len(self._units) - on_nvme, on_nvme,
                 f", frozen in the shared base {self.shared_base!r}" if self._base else "")

    def _lay_out_all(self, source, write: bool) -> None:
        what = "Loading weights" if isinstance(source, FromCheckpoint) else "Making weights"
        self._units.lay_out_all(source.unit_values, write, what, self.progress)

    def _lay_out_ranks(self, source) -> None:
        """The node's first rank makes the ranks' base and writes the weights, then the others
        open it; a rank that fails makes every rank fail, naming it (_ranks.py)."""
        ranks = self._ranks
        error = None
        if ranks.leader:
            try:
                ranks.make()
                self._lay_out_all(source, write=True)
                ranks.seal()
            except Exception as e:  # noqa: BLE001 (every rank learns of it)
                error = e
        ranks.agree("make the ranks' weights", error)
        error = None
        if not ranks.leader:
            try:
                ranks.open()
                self._lay_out_all(source, write=False)
            except Exception as e:  # noqa: BLE001
                error = e
        ranks.agree("open the ranks' weights", error)

    def _check_budget(self, units: List[Unit]) -> None:
        resident = sum(t.numel() * t.element_size() for t in self._resident)
        largest = max(sum(p.numel() * p.element_size() for p in u.params) for u in units)
        need = resident + self.window_units * largest + largest  # and one unit's gradients
        self.resident_bytes = resident
        self.largest_unit_bytes = largest
        if self.device_budget_bytes < need:
            raise InvalidArgument(
                f"stream_parameters: a device budget of {self.device_budget_bytes:,} bytes is "
                f"below the {need:,} needed: {resident:,} resident + ({self.prefetch} prefetch + "
                f"2) x {largest:,} (the largest unit) + {largest:,} (its gradients)")

    def _check_open(self) -> None:
        if self.closed:
            raise FailedPrecondition("stream_parameters: the stream was closed")

    # ---- the user's ----

    @property
    def closed(self) -> bool:
        return self._parts is None or self._parts.closed

    @property
    def stats(self) -> Dict[str, float]:
        """Figures since the stream was made: device_peak_bytes (resident + units in the window),
        h2d_bytes (weights fetched), d2h_bytes (gradients sent off), nvme_read_bytes (NVMe to
        host, the whole node), wait_s (compute waiting for weights), trace_misses, on_demand
        (units not prefetched when asked for), fetches, iterations, over_window, schedules (the
        daemon told the trace), base_check_wait_s (with a shared base opened from a checkpoint:
        what the job waited for the check of its checkpoint, _base_check.py)."""
        s = self._figures.as_dict()
        s["device_peak_bytes"] = self._window.peak
        s["units_on_nvme"] = sum(1 for u in self._units if u.home == Tier.NVME)
        if self._base is not None and self._base.check is not None:
            s["base_check_wait_s"] = self._base.check.waited_s
        s["device_live_bytes"] = self._window.live
        if self._client is not None and not self._client.closed:
            s["nvme_read_bytes"] = self._client.path_bytes("nvme_to_host") - self._nvme_start
            session = self._client.stats()
            s["planner_fetches"] = session.planner_fetches
            s["acquired_waited"] = session.acquired_waited
        return s

    @property
    def window(self) -> int:
        warnings.warn("ParameterStream.window is deprecated: use window_units", FutureWarning,
                      stacklevel=2)
        return self.window_units

    @property
    def units(self) -> List[str]:
        return [u.name for u in self._units]

    def gathered(self):
        """A context in which every streamed parameter holds its weights on the CPU (the model's
        state_dict, torch.save, edits; a forward inside runs on those weights, the hooks standing
        aside); weights changed inside are kept (and OffloadedAdamW takes them as its master
        weights at its next step). To evaluate on the device, run the forward outside it, under
        torch.no_grad(): it streams as training does."""
        return Gathered(self._units, self._window, self._hooks, self._base, self._check_open,
                        self)

    def save_pretrained(self, directory: str, max_shard_size="5GB",
                        progress: Optional[bool] = None) -> List[str]:
        """Writes the model's weights (its state_dict: the streamed ones read unit by unit, the
        resident ones from the device) as safetensors shards of at most max_shard_size ("5GB",
        "500MB" or bytes) with an index, in the Hugging Face layout, and the model's config when
        it has one (transformers' `config.save_pretrained`): `from_pretrained(directory)` loads
        it. A weight tied to another is written once, under its first name. On a base that peft
        has wrapped, the base is written as it was (a LoRA layer's base_layer under the layer's
        own name; the adapters are peft's to save). At most one shard is in memory, never the
        whole model. Between steps; returns the files written. `progress`: a bar as
        stream_parameters' (default: the stream's own setting)."""
        self._check_open()
        if self._hooks.busy():
            raise FailedPrecondition("stream_parameters: save_pretrained() during a forward or "
                                     "backward, or inside gathered()")
        if self._base is not None:
            self._base.checked()
        return save_pretrained(self.model, self._units, self._window, directory, max_shard_size,
                               self.progress if progress is None else progress)

    def close(self, keep_weights: Optional[bool] = None) -> None:
        """Removes the hooks and frees the chunks. keep_weights: give every streamed parameter
        its weights back as a CPU tensor first; by default, unless the model was built on the
        meta device (a model larger than memory: save_pretrained() first), whose streamed
        parameters are then left without storage."""
        if keep_weights is None:
            keep_weights = not getattr(self, "built_on_meta", False)
        if self.closed:
            if getattr(self, "_base", None) is not None:  # a set-up that failed after opening it
                self._base.release()
            if getattr(self, "_ranks", None) is not None:
                self._ranks.release()
            if getattr(self, "_own_client", False) and getattr(self, "_client", None):
                self._client.close()
                self._client = None
            return
        if keep_weights and self._base is not None:
            try:
                self._base.checked()  # the weights handed back are the checkpoint's
            except ValueError as e:
                keep_weights = False
                warnings.warn(f"stream_parameters: {e}; the streamed parameters are left without "
                              "storage", RuntimeWarning, stacklevel=2)
        for installed in (self._hooks, self._loading, self._ddp):
            installed.remove()
        lost = None
        try:
            for u in self._units:
                self._window.evict(u)
                try:
                    weights = self._units.weights(u) if u.chunks is not None and keep_weights \
                        else []
                except TierdError as e:  # the daemon is gone: so are the weights
                    lost, weights = e, []
                with torch.no_grad():
                    for p, w in weights:
                        p.data = w.view(p.shape)
                        unguard(p)  # a plain parameter again, with its weights
                try:  # a dead daemon's chunks are gone with it
                    self._units.free(u)
                except TierdError as e:
                    lost = lost or e
            if self._base is not None:
                self._base.release()
            if self._ranks is not None:
                self._ranks.release()
        finally:
            self._parts.closed = True
            self._window.close()
            if self._own_client and self._client is not None:
                self._client.close()
                self._client = None
        if lost is not None:
            warnings.warn(f"stream_parameters: the streamed weights could not be read back "
                          f"({lost}); the streamed parameters stay without storage",
                          RuntimeWarning, stacklevel=2)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"ParameterStream({len(self._units)} units, window {self.window_units}, device "
                f"{self.device}, budget {self.device_budget_bytes:,} bytes)")


def _resident_tensors(model: nn.Module, streamed) -> List[torch.Tensor]:
    kept = {id(t): t for t in list(model.parameters()) + list(model.buffers())
            if id(t) not in streamed}  # each tensor once, where it first comes
    return list(kept.values())


def stream_parameters(model: nn.Module, units: Optional[Sequence[nn.Module]] = None,
                      device: Optional[torch.device] = None,
                      device_budget_bytes: int = 8 << 30, prefetch: int = 1,
                      host_budget_bytes: Optional[int] = None, name: Optional[str] = None,
                      checkpoint: Optional[str] = None, init: Optional[Init] = None,
                      **kwargs) -> ParameterStream:
    """Streams the model's units' weights through a device window (see the module's text).

    units: module subtrees fetched, released and stepped together (default: the blocks of the
        model's largest nn.ModuleList of like blocks); parameters outside them, or also used
        outside them (tied), stay resident on the device.
    device: the compute device (torch.device("cpu") with a budget is an emulated GPU).
    device_budget_bytes: at least resident + (prefetch + 2) x the largest unit + its gradients.
    prefetch: units copied ahead of the one computing.
    host_budget_bytes: the units' chunks (two versions each) at home in the host tier up to this;
        the rest on NVMe. None: all in the host tier.
    checkpoint: take the weights from this checkpoint in the Hugging Face layout (a .safetensors
        file, or a directory with model.safetensors or shards and model.safetensors.index.json),
        matched by state_dict name and converted to the model's dtypes; every key, shape and
        dtype is checked before anything is written. The model may be built on the meta device
        (with torch.device("meta"), accelerate's init_empty_weights()): each unit is read
        straight into its chunks, one at a time, and the resident tensors made on `device`.
    init: for a model built on the meta device without a checkpoint: init(module) makes the
        weights of each unit (materialised on a CPU staging copy) and of each module holding
        resident tensors (on `device`). Default: the model's own initialisation (transformers'
        _init_weights, else each module's reset_parameters()).
    share_ranks: with torch.distributed initialised, the job's ranks on each node stream one set
        of weights (each unit's two versions) instead of one each: the node's first rank writes
        them, OffloadedAdamW (sharded over the ranks) has each bucket's owner step it into the
        shared next version, and every rank flips it at the same point of the step. The ranks'
        gradients are summed in the node's memory; on several nodes (as many ranks on each),
        only the node sums and each node's new weights travel between them. Needs the same
        `name` on every rank and the sessions' job declared ($TIERD_JOB).
        (docs/streaming.md, "A job's ranks on one node")
    shared_base: the name of a shared base on the node ("llama-3-8b@main"): every streamed
        parameter is frozen and read from one read-only copy that every job on the node opens
        by this name; the first job makes it from its checkpoint (or the model's weights), the
        others open it, and the daemon counts it once. Adapters added afterwards (peft) are the
        job's own. A base of another layout or other weights under the name is refused.
        (docs/streaming.md, "One copy per node")
    share_with_group: a gid whose members may open the base too (one the daemon's base_groups
        names); default: this user's jobs only.
    base_wait_s: how long to wait for another job that is making the base.
    trust_base_makers: users (names or uids) besides this one and root whose bases this job
        opens: a base made by anyone else is refused (PermissionError), since its descriptor
        is its maker's word for what it holds.
    client, socket_dir: the daemon session (default: a session of its own).
    progress: a progress bar (tqdm's, bytes and rate) while the weights are written in (from a
        checkpoint, an init, or into a shared base this job makes) and in save_pretrained():
        True at once, False never, None (default) when standard error is a terminal and the work
        takes more than a second, unless TIERD_PROGRESS=0.
    """
    return ParameterStream(model, units, device, device_budget_bytes, prefetch,
                           host_budget_bytes, name, checkpoint=checkpoint, init=init, **kwargs)
