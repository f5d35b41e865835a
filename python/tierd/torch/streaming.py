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

The rooms, each over the ones before it: _units.py (the units, their layout and chunks),
_trace.py (the order recorded over the first iteration, the daemon's schedule), _window.py (the
device storage, fetch and release), _stream_hooks.py (the hooks and the training state). Tensors
autograd saved in forward that view a parameter (a weight's transpose) view the unit's storage,
so backward reads the weights fetched for it.

OffloadedAdamW steps streamed parameters through one seam: stream_ranges() lays each unit out as
one range per parameter group and dtype and hands back a StreamRange for each. Gradients leave
the device as autograd finishes each one into the range's gradient chunk; the kernel writes the
new weights into the range's next version, which StreamRange.publish makes current (the stream
flips it); a step rolled back or skipped leaves the current version as it was.
"""
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..client import Access, Acquisition, Client, Tier, TierdError, connect
from ._stream_hooks import StreamHooks, TrainingState
from . import _pretrained
from ._materialize import Init, placeholder, source_for, swap
from ._base import SharedBase
from ._guard import guard, unguard
from ._hf_keys import KeyNames
from ._loading import StateDictLoading
from ._ranks import RankWeights
from ._trace import Trace
from ._units import Range, Unit, Units, by_dtype, find_units
from ._window import Window

__all__ = ["ParameterStream", "StreamRange", "stream_parameters", "stream_ranges"]

# Every streamed parameter (by id) -> its stream: how OffloadedAdamW finds them.
_STREAMED: "weakref.WeakValueDictionary[int, ParameterStream]" = weakref.WeakValueDictionary()


def stream_of(p: torch.Tensor) -> Optional["ParameterStream"]:
    """The open stream that streams parameter p, if any."""
    s = _STREAMED.get(id(p))
    if s is None or s.closed or not s._units.streams(p):
        return None
    return s


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
                 share_ranks: bool = False):
        device = torch.device(device if device is not None else "cuda")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, not {prefetch}")
        if host_budget_bytes is not None and host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0, not {host_budget_bytes}")
        self.closed = True  # until set up: close() and __del__ read it
        self.model = model
        self.device = device
        self.device_budget_bytes = int(device_budget_bytes)
        self.prefetch = int(prefetch)
        self.window = self.prefetch + 2
        self.host_budget_bytes = host_budget_bytes
        self.name = name or type(model).__name__
        self.shared_base = shared_base
        self._base = None
        self._ranks = None
        if share_ranks and shared_base is not None:
            raise ValueError("stream_parameters: shared_base (a frozen base, read-only) and "
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
        self._stats = dict(fetches=0, on_demand=0, trace_misses=0, h2d_bytes=0, d2h_bytes=0,
                           wait_s=0.0, iterations=0, over_window=0, schedules=0)
        self._nvme_start = self._client.path_bytes("nvme_to_host")
        self._units = Units(found, self._client, device)
        self._trace = Trace(self._units, self._stats)
        self._window = Window(self._units, self._trace, device, self.prefetch, self._stats)
        self._hooks = StreamHooks(self._units, self._window)
        self._loading = StateDictLoading(self._units, self._window, self._hooks.busy)
        try:
            name, group, wait_s, trusted = base
            if name is not None:
                self._base = SharedBase(self._client, name, self._units, source.names.of, group,
                                        wait_s, trusted)
            if share_ranks:
                self._ranks = RankWeights(self._client, self.name, self._units, source.names.of)
            self._units.place(host_budget_bytes, has_nvme,
                              self._base.bytes if self._base is not None else None,
                              allocate=self._ranks is None)
            if self._base is not None:
                self._base.attach(source, {u.index: u.home for u in self._units})
            self._window.add_resident(sum(t.numel() * t.element_size() for t in self._resident))
            self.closed = False
            if self._ranks is None:
                self._lay_out_all(source, write=True)
            else:
                self._lay_out_ranks(source)
            for u in self._units:
                for p in u.params:
                    _STREAMED[id(p)] = self
                    guard(p)  # outside the window, a use that reads it raises
            self._hooks.install()
            self._loading.install()
        except BaseException:
            self.close()
            raise

    def _lay_out_all(self, source, write: bool) -> None:
        """Every unit laid out, its weights written from `source` (one unit's in the process at
        a time) and an NVMe unit's written down; without `write`, the layout only."""
        written = []
        for u in self._units:
            own = u.own_params()
            values = source.unit_values(u.module, own) if own and write else {}
            self._units.lay_out(u, by_dtype(own), 1, values, write=write)
            if write:
                written.append(self._units.write_down(u))
        for w in written:
            if w is not None:
                w.wait()

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
        need = resident + self.window * largest + largest  # the window, and one unit's grads
        self.resident_bytes = resident
        self.largest_unit_bytes = largest
        if self.device_budget_bytes < need:
            raise ValueError(
                f"stream_parameters: a device budget of {self.device_budget_bytes:,} bytes is "
                f"below the {need:,} needed: {resident:,} resident + ({self.prefetch} prefetch + "
                f"2) x {largest:,} (the largest unit) + {largest:,} (its gradients)")

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("stream_parameters: the stream was closed")

    # ---- for OffloadedAdamW: the seam ----

    def _claim(self, layout: Dict[int, List[List[torch.Tensor]]]) -> Dict[int, List[Range]]:
        """Lays each unit (index -> lists of its parameters) out anew as one range per list, the
        rest of its parameters after them by dtype, moving the current weights. Between steps."""
        out, written = {}, []
        with self._window.lock:
            for index, groups in layout.items():
                u = self._units[index]
                if u.refs:
                    raise RuntimeError("stream_parameters: units are rearranged between steps, "
                                       "not during a forward or backward")
                self._window.release(u)  # a copy left in the window by an evaluation
                taken = {id(p) for g in groups for p in g}
                own = u.own_params()
                rest = by_dtype([p for p in own if id(p) not in taken])
                write = self._ranks is None or self._ranks.leader
                mine = {id(p) for p in own}
                values = {id(p): w for p, w in self._units.weights(u) if id(p) in mine} \
                    if write else {}
                self._units.lay_out(u, groups + rest, 1, values, write=write)
                if write:
                    written.append(self._units.write_down(u))
                out[index] = u.ranges[:len(groups)]  # gradient chunks made as gradients come
            self._trace.laid_out()
        for w in written:
            if w is not None:
                w.wait()
        if self._ranks is not None:  # the node's first rank has moved the weights
            self._ranks.barrier()
        return out

    def _flipped(self, u: Unit, r: Range) -> None:
        """Range r of u has new weights: a copy of the old ones in the window goes."""
        with self._window.lock:
            self._trace.flipped(r)
            if u.refs == 0:
                self._window.release(u)

    # ---- the user's ----

    @property
    def stats(self) -> Dict[str, float]:
        """Figures since the stream was made: device_peak_bytes (resident + units in the window),
        h2d_bytes (weights fetched), d2h_bytes (gradients sent off), nvme_read_bytes (NVMe to
        host, the whole node), wait_s (compute waiting for weights), trace_misses, on_demand
        (units not prefetched when asked for), fetches, iterations, over_window, schedules (the
        daemon told the trace), base_check_wait_s (with a shared base opened from a checkpoint:
        what the job waited for the check of its checkpoint, _base_check.py)."""
        s = dict(self._stats)
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
    def units(self) -> List[str]:
        return [u.name for u in self._units]

    def gathered(self):
        """A context in which every streamed parameter holds its weights on the CPU (the model's
        state_dict, torch.save, edits; a forward inside runs on those weights, the hooks standing
        aside); weights changed inside are kept (and OffloadedAdamW takes them as its master
        weights at its next step). To evaluate on the device, run the forward outside it, under
        torch.no_grad(): it streams as training does."""
        return _Gathered(self)

    def save_pretrained(self, directory: str, max_shard_size="5GB") -> List[str]:
        """Writes the model's weights (its state_dict: the streamed ones read unit by unit, the
        resident ones from the device) as safetensors shards of at most max_shard_size ("5GB",
        "500MB" or bytes) with an index, in the Hugging Face layout, and the model's config when
        it has one (transformers' `config.save_pretrained`): `from_pretrained(directory)` loads
        it. A weight tied to another is written once, under its first name. On a base that peft
        has wrapped, the base is written as it was (a LoRA layer's base_layer under the layer's
        own name; the adapters are peft's to save). At most one shard is in memory, never the
        whole model. Between steps; returns the files written."""
        self._check_open()
        if self._hooks.busy():
            raise RuntimeError("stream_parameters: save_pretrained() during a forward or "
                               "backward, or inside gathered()")
        if self._base is not None:
            self._base.checked()
        size = _pretrained.parse_size(max_shard_size)
        entries, seen = [], set()
        tensors: Dict[str, torch.Tensor] = {}
        keys = KeyNames(self.model)  # the keys save_pretrained writes
        for name, t in _base_state(self.model).items():
            if id(t) in seen:
                continue  # tied: written once
            seen.add(id(t))
            key = keys.to_checkpoint(name)
            entries.append((key, tuple(t.shape), t.dtype))
            tensors[key] = t
        cached: Dict[int, Dict[int, torch.Tensor]] = {}  # the unit being written

        def read(name: str) -> torch.Tensor:
            t = tensors[name]
            u = self._units.unit_of(t)
            if u is None:
                return t.detach().to("cpu", copy=True)
            if u.index not in cached:
                cached.clear()
                cached[u.index] = {id(p): w for p, w in self._units.weights(u)}
            return cached[u.index][id(t)].view(t.shape)

        with self._window.lock:
            written = _pretrained.write(directory, entries, read, size)
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
        generation = getattr(self.model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(directory)
        return written

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
        self._hooks.remove()
        self._loading.remove()
        lost = None
        try:
            for u in self._units:
                self._window.release(u)
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
            self.closed = True
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
        return (f"ParameterStream({len(self._units)} units, window {self.window}, device "
                f"{self.device}, budget {self.device_budget_bytes:,} bytes)")


def _base_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's state_dict (its tensors, not copies) as the model was before peft injected
    adapter layers into it: each such layer's `base_layer` tensors under the layer's name, its
    adapters left out."""
    state = model.state_dict(keep_vars=True)
    injected = [n for n, m in model.named_modules()
                if type(m).__module__.startswith("peft.") and hasattr(m, "base_layer")]
    if not injected:
        return state
    out: Dict[str, torch.Tensor] = {}
    for name, t in state.items():
        layer = next((n for n in injected if name.startswith(n + ".")), None)
        if layer is None:
            out[name] = t
        elif name.startswith(layer + ".base_layer."):
            out[layer + "." + name[len(layer + ".base_layer."):]] = t
    return out


def _resident_tensors(model: nn.Module, streamed) -> List[torch.Tensor]:
    seen, out = set(), []
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in streamed and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class StreamRange:
    """OffloadedAdamW's handle on one range of a streamed unit: its parameters laid end to end,
    the weights' current version, the next version a step writes, and a gradient chunk. The
    stream owns the layout and the version flip (publish); the optimizer reads and writes the
    unit's chunks through this handle only."""

    def __init__(self, stream: ParameterStream, unit: Unit, r: Range):
        self._stream = stream
        self._unit = unit
        self._range = r
        self.params = r.params
        self._next = None   # the next version, held from next_version() to publish/discard
        self._grads = None  # the gradient chunk, held from gradients() to release_gradients
        # Set aside: written this step but not held (set_aside, set_gradients_aside); held again
        # with their contents kept.
        self._next_aside = False
        self._grads_aside = False

    @property
    def nodes(self):
        """With share_ranks, the job's ranks by node (_ranks.Nodes): the ranks of each node share
        the range's chunks, its next version is written by one rank of the node (the bucket's
        owner, or its node owner) and every rank flips it. None: the chunks are this rank's."""
        ranks = self._stream._ranks
        return ranks.nodes if ranks is not None else None

    @property
    def pages(self) -> bool:
        """Whether the range's unit is at home on NVMe: what it holds during a step is worth
        giving back as soon as the step is done with it (set_aside, set_gradients_aside)."""
        return self._unit.home == Tier.NVME

    def _check(self) -> Range:
        if self._stream.closed:
            raise RuntimeError("OffloadedAdamW: the parameter stream of these parameters was "
                               "closed (close the optimizer first)")
        if self._range.retired:
            raise RuntimeError("stream_parameters: these parameters were laid out anew for "
                               "another optimizer")
        return self._range

    def read(self, i: Optional[int] = None) -> torch.Tensor:
        """A copy of the current weights: all of them (flat), or parameter i's alone."""
        r = self._check()
        units = self._stream._units
        with units.holding(self._unit, r.current, Access.READ) as view:
            values = units.range_view(view, r)
            return (values[:r.numel] if i is None else r.slice(values, i)).clone()

    def read_into(self, out: torch.Tensor) -> None:
        """Copies the current weights, all of them, into `out` (flat: the next version's)."""
        r = self._check()
        units = self._stream._units
        with units.holding(self._unit, r.current, Access.READ) as view:
            out[:r.numel].copy_(units.range_view(view, r)[:r.numel])

    def write(self, flat: torch.Tensor) -> None:
        """Sets every weight of the current version from `flat`."""
        r = self._check()
        units = self._stream._units
        with units.holding(self._unit, r.current, Access.WRITE) as view:
            units.range_view(view, r)[:r.numel].copy_(flat.reshape(-1))

    def next_version(self) -> torch.Tensor:
        """A view of the next version (values, then extras) for a step's new weights, held until
        publish() or discard()."""
        if self._next is None:
            r = self._check()
            access = Access.WRITE if self._next_aside else Access.OVERWRITE
            view, held = self._stream._units.hold(self._unit, 1 - r.current, access)
            self._next = (Units.range_view(view, r), held)
        return self._next[0]

    def set_aside(self) -> None:
        """The step's kernel is done writing the next version: its hold goes (the daemon may
        write it down), its contents stay for publish()."""
        self._next = _let_go(self._next)
        self._next_aside = True

    def publish(self, stepped: Sequence[bool]) -> None:
        """The next version becomes current: the new weights where `stepped`, the current ones
        copied across elsewhere (only then is the next version held again)."""
        self.complete(stepped)
        self.flip()

    def complete(self, stepped: Sequence[bool]) -> None:
        """The next version made whole: the current weights copied across where not `stepped`."""
        r = self._check()
        if not all(stepped):
            out = self.next_version()
            now = self.read()
            for i in range(len(stepped)):
                if not stepped[i]:
                    r.slice(out, i).copy_(r.slice(now, i))

    def flip(self) -> None:
        """The next version (complete) becomes current."""
        r = self._check()
        r.current = 1 - r.current
        self.discard()
        self._stream._flipped(self._unit, r)

    def discard(self) -> None:
        """Lets the next version go, unpublished (a step abandoned, or published)."""
        self._next = _let_go(self._next)
        self._next_aside = False

    def gradients(self) -> torch.Tensor:
        """A view of the gradient chunk (values, then extras), held until release_gradients()
        or set_gradients_aside()."""
        if self._grads is None:
            self._grads = self._stream._units.hold_grad(self._unit, self._check(),
                                                        keep=self._grads_aside)
        return self._grads[0]

    def gradients_aside(self) -> bool:
        return self._grads_aside

    def sum_gradients(self) -> None:
        """The gradients of the node's ranks of the range (each left in the daemon's memory by
        its backward) summed into this rank's, held: a reduce over the node, nothing moved."""
        self._stream._units.sum_rank_grads(self._unit, self._check(), self.gradients())

    def set_gradients_aside(self, free: bool) -> None:
        """The gradients are not needed in memory now: their hold goes. `free`: nothing reads
        them again this step (the chunk goes, made anew at the next step's first gradient);
        else they are kept, and gradients() holds them again as they are."""
        self._grads = _let_go(self._grads)
        if free:
            self._stream._units.drop_grad(self._range)
        self._grads_aside = not free

    def release_gradients(self) -> None:
        self._grads = _let_go(self._grads)
        self._grads_aside = False

    def gradient_sent(self, i: int) -> None:
        """Parameter i's gradient was taken off the device (and is dropped there)."""
        p = self.params[i]
        self._stream._stats["d2h_bytes"] += p.numel() * p.element_size()
        p.grad = None

    def edited(self, i: int) -> bool:
        """Whether gathered() changed parameter i's weights since clear_edited(i)."""
        return id(self.params[i]) in self._unit.edited

    def clear_edited(self, i: int) -> None:
        self._unit.edited.discard(id(self.params[i]))


def _let_go(held: Optional[Tuple[torch.Tensor, Optional[Acquisition]]]) -> None:
    """Releases a (view, acquisition) hold once its views are gone; None, to store back."""
    if held is not None and held[1] is not None:
        held[1].release_deferred()
    return None


def stream_ranges(keyed: List[Tuple[Any, torch.Tensor]]
                  ) -> Tuple[List[Tuple[Any, StreamRange]], List[Tuple[Any, torch.Tensor]]]:
    """The one place a streamed unit becomes an optimizer's ranges. `keyed`: (key, parameter),
    the key a parameter group's index. Each unit with a parameter among them is laid out anew:
    one range per key and dtype of its parameters there (its other parameters after them);
    returns those ranges as (key, StreamRange), keys in descending order and within a key the
    units in backward's order, and the parameters not streamed, as given. Parameters of a
    shared base are left out (frozen; refused when they require gradients). Between steps."""
    layouts: Dict[int, Dict[int, Dict[Tuple[Any, str], List[torch.Tensor]]]] = {}
    streams: Dict[int, ParameterStream] = {}
    plain = []
    for key, p in keyed:
        s = stream_of(p)
        if s is None:
            plain.append((key, p))
            continue
        if s._units.unit_of(p).in_base(p):  # read-only: never stepped, never given state
            if p.requires_grad:
                raise ValueError(f"OffloadedAdamW: a parameter of shape {tuple(p.shape)} is in "
                                 f"the shared base {s.shared_base!r}, which is read-only: keep "
                                 "it frozen (requires_grad=False) and train adapters beside it")
            continue
        streams[id(s)] = s
        u = s._units.unit_of(p)
        layouts.setdefault(id(s), {}).setdefault(u.index, {}).setdefault(
            (key, str(p.dtype)), []).append(p)
    found = []
    for sid, by_unit in layouts.items():
        s = streams[sid]
        order = {index: sorted(lists, key=lambda k: (-k[0], k[1]))
                 for index, lists in by_unit.items()}
        claimed = s._claim({index: [by_unit[index][k] for k in keys]
                            for index, keys in order.items()})
        for index, keys in order.items():
            u = s._units[index]
            for k, r in zip(keys, claimed[index]):
                found.append(((-k[0], sid, -index, k[1]), k[0], StreamRange(s, u, r)))
    found.sort(key=lambda f: f[0])
    return [(key, rng) for _, key, rng in found], plain


class _Gathered:
    def __init__(self, stream: ParameterStream):
        self.stream = stream
        self.before: List[Tuple[Unit, List[Tuple[torch.Tensor, torch.Tensor]]]] = []

    def __enter__(self):
        s = self.stream
        s._check_open()
        if s._base is not None:
            s._base.checked()
        if s._hooks.busy():
            raise RuntimeError("stream_parameters: gathered() during a forward or backward, or "
                               "inside another gathered()")
        for u in s._units:
            s._window.release(u)
            weights = s._units.weights(u)
            self.before.append((u, weights))
            with torch.no_grad():
                for p, w in weights:
                    p.data = w.clone().view(p.shape)
        s._hooks.state = TrainingState.GATHERED
        return s

    def __exit__(self, *exc):
        s = self.stream
        s._hooks.state = TrainingState.IDLE
        units = s._units
        for u, weights in self.before:
            changed = {}
            for p, w in weights:
                now = p.detach().reshape(-1)
                if now.dtype != w.dtype or now.numel() != w.numel():
                    raise RuntimeError("stream_parameters: a streamed parameter's dtype or "
                                       "shape changed inside gathered()")
                if not torch.equal(now, w):
                    changed[id(p)] = now.clone()
            try:
                units.write_weights(u, changed)
            except ValueError:
                raise RuntimeError(f"stream_parameters: a parameter of unit {u.name!r} was "
                                   "changed inside gathered(), but it is in the shared base "
                                   f"{s.shared_base!r}, which is read-only; its weights stay as "
                                   "they were") from None
            finally:
                units.point(u)
        self.before = []


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
    """
    return ParameterStream(model, units, device, device_budget_bytes, prefetch,
                           host_budget_bytes, name, checkpoint=checkpoint, init=init, **kwargs)
