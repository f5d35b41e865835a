"""Where a streamed model's weights come from: the model's own tensors, a checkpoint in the Hugging
Face layout, or an initialisation. The last two take a model built on the meta device
(`with torch.device("meta")`, accelerate's init_empty_weights(), transformers' from_config under
either) and give each unit's weights one unit at a time, so the model is never whole in the
process; the tensors that stay resident are made on the device.

Everything a checkpoint must match (every key, shape and dtype) is checked by check() before
streaming.py writes any chunk. A buffer that is not saved (a RoPE table) and that the meta build
left without data is recomputed by the model's own code (transformers' `_init_weights`, or the
module's `reset_parameters`) and refused, by name, when neither recomputes it.

A checkpoint's resident tensors (the embedding, the head) are made empty by make_resident and
read on a thread of their own while the daemon reads the units' weights; wait_resident() waits
for their values.
"""
import concurrent.futures
import copy
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from .._errors import InvalidArgument
from ._hf_keys import KeyNames
from ._safetensors import Checkpoint, convertible

Init = Callable[[nn.Module], None]


class Names:
    """Every name of each parameter and buffer of the model (a tied parameter has several), and
    which buffers are persistent (in the state_dict)."""

    def __init__(self, model: nn.Module):
        self.of: Dict[int, List[str]] = {}
        self.owner: Dict[str, nn.Module] = {}
        self.state_names = set()  # ids of the tensors in the state_dict
        for mname, m in model.named_modules(remove_duplicate=False):
            prefix = mname + "." if mname else ""
            for n, p in m.named_parameters(recurse=False):
                self._add(prefix + n, p, m)
                self.state_names.add(id(p))
            for n, b in m.named_buffers(recurse=False):
                if b is None:
                    continue
                self._add(prefix + n, b, m)
                if n not in m._non_persistent_buffers_set:
                    self.state_names.add(id(b))

    def _add(self, name: str, t: torch.Tensor, m: nn.Module) -> None:
        names = self.of.setdefault(id(t), [])
        if name not in names:
            names.append(name)
        self.owner.setdefault(name, m)

    def saved(self, t: torch.Tensor) -> bool:
        """Whether t is in the model's state_dict (a parameter or a persistent buffer)."""
        return id(t) in self.state_names

    def follow(self, made: Dict[int, torch.Tensor]) -> None:
        """The replacements (old id -> new tensor) take their tensors' names."""
        for old, new in made.items():
            if old in self.of:
                self.of[id(new)] = self.of.pop(old)
            if old in self.state_names:
                self.state_names.discard(old)
                self.state_names.add(id(new))


def on_meta(model: nn.Module) -> List[str]:
    """The names of the model's tensors on the meta device (empty when none is)."""
    out = []
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is not None and t.is_meta:
            out.append(n)
    return out


def own_init(model: nn.Module) -> Init:
    """The model's own initialisation of one module (its direct parameters and buffers):
    transformers' `_init_weights` where the model has it, else the module's
    `reset_parameters()`."""
    hf = getattr(model, "_init_weights", None)

    def init(m: nn.Module) -> None:
        if callable(hf):
            hf(m)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return init


class Source:
    """The weights of a stream's units and resident tensors (see the module's text)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = Names(model)
        self.built_on_meta = bool(on_meta(model))

    def check(self, streamed: List[torch.Tensor], resident: List[torch.Tensor]) -> None:
        """Raises, naming what is wrong, before anything is written."""

    def identity(self) -> Dict[str, str]:
        """Where the weights come from, as a shared base records and compares it: "weights" (the
        model's own, compared by their contents), "checkpoint" (with its digest) or "init"
        (made up: no base is made from it or opened with it)."""
        return {"kind": "weights"}

    def unit_values(self, module: nn.Module, params: List[torch.Tensor]) -> Dict[int, Any]:
        """Each of the unit's parameters (by id) -> its weights, flat, on the CPU, or a
        function that writes them into the flat CPU tensor it is given (Units.lay_out)."""
        return {id(p): p.detach().reshape(-1) for p in params}

    def make_resident(self, resident: List[torch.Tensor], device: torch.device
                      ) -> Dict[int, torch.Tensor]:
        """The resident tensors with their values, on `device` (some may come later: see
        wait_resident). A tensor on meta cannot take data: it is replaced, and the replacements
        returned (old id -> new; swap() puts them into the model)."""
        made: Dict[int, torch.Tensor] = {}
        for t in resident:
            if t.device != device:
                _set(t, t.detach().to(device), made)
        return made

    def wait_resident(self) -> None:
        """The values make_resident left to come are in place (raises if they could not be)."""

    def follow(self, made: Dict[int, torch.Tensor]) -> None:
        """The model's tensors were replaced (old id -> new): what is known of them follows."""
        self.names.follow(made)

    def close(self) -> None:
        pass

    # ---- for the sources of a meta build ----

    def _recompute_unsaved(self, resident: List[torch.Tensor], device: torch.device,
                           made: Dict[int, torch.Tensor]) -> None:
        """Buffers not in the state_dict that are on meta: made on the device and computed by
        the model's own code, or refused by name."""
        unsaved = [t for t in resident if t.is_meta and not self.names.saved(t)]
        init = own_init(self.model)
        has_init = callable(getattr(self.model, "_init_weights", None))
        owners: Dict[int, nn.Module] = {}
        for t in unsaved:
            name = self.names.of[id(t)][0]
            m = self.names.owner[name]
            if not has_init and not hasattr(m, "reset_parameters"):
                raise InvalidArgument(f"stream_parameters: buffer {name!r} is not saved in a "
                                      "checkpoint and the meta build left it without data; its "
                                      f"module ({type(m).__name__}) has no reset_parameters() to "
                                      "compute it: build that module off the meta device")
            owners[id(m)] = m
        for m in owners.values():
            replaced = []
            for n, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[n] = torch.full_like(b, float("nan"), device=device) \
                        if b.is_floating_point() else torch.zeros_like(b, device=device)
                    replaced.append((n, id(b)))
            with torch.no_grad():
                init(m)
            for n, old in replaced:
                b = m._buffers[n]  # as the init left it (it may assign anew)
                if b.is_floating_point() and bool(torch.isnan(b).any()):
                    raise InvalidArgument(f"stream_parameters: buffer {self._name(m, n)!r} is not "
                                          "saved in a checkpoint and the meta build left it "
                                          "without data; the model's own initialisation does not "
                                          f"compute it: build its module ({type(m).__name__}) off "
                                          "the meta device")
                made[old] = b

    def _name(self, m: nn.Module, local: str) -> str:
        for name, owner in self.names.owner.items():
            if owner is m and name.rsplit(".", 1)[-1] == local:
                return name
        return local


def _set(t: torch.Tensor, value: torch.Tensor, made: Dict[int, torch.Tensor]) -> None:
    """t takes `value`: in place where it can, else (on meta) through a replacement."""
    if t.is_meta:
        made[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else value
    else:
        t.data = value


def placeholder(p: torch.Tensor, device: torch.device) -> nn.Parameter:
    """A parameter of p's shape, dtype and requires_grad on `device` that holds one element (a
    streamed parameter on meta, before the stream points it at its unit's storage)."""
    return nn.Parameter(torch.zeros((), dtype=p.dtype, device=device).expand(p.shape),
                        requires_grad=p.requires_grad)


def swap(model: nn.Module, made: Dict[int, torch.Tensor]) -> None:
    """Puts the replacements (old id -> new) into every module that holds the old tensors."""
    if not made:
        return
    for m in model.modules():
        for store in (m._parameters, m._buffers):
            for n, t in list(store.items()):
                if t is not None and id(t) in made:
                    store[n] = made[id(t)]


class FromModel(Source):
    """The weights the model holds."""


class FromCheckpoint(Source):
    """Weights from a checkpoint in the Hugging Face layout, matched by state_dict name; each
    tensor converted to the model's dtype (floating point only)."""

    def __init__(self, model: nn.Module, path: str):
        super().__init__(model)
        self.checkpoint = Checkpoint(path)
        self._key: Dict[int, str] = {}
        self._reading: Optional[concurrent.futures.Future] = None  # the residents' values

    def check(self, streamed, resident) -> None:
        entries = self.checkpoint.entries
        # Each key under the model's name for it, as from_pretrained renames it (_hf_keys.py).
        keys = KeyNames(self.model)
        known = {n: True for ns in self.names.of.values() for n in ns}
        by_name, converted = {}, {}
        for key in entries:
            name, pattern = keys.to_model(key, known)
            if pattern is not None:
                converted[key] = pattern
            else:
                by_name.setdefault(name, key)
        used = set()
        for t in streamed + [t for t in resident if self.names.saved(t)]:
            names = self.names.of[id(t)]
            key = next((by_name[n] for n in names if n in by_name), None)
            if key is None:
                near = next(iter(converted), None)
                why = f"; key {near!r} needs transformers' conversion {converted[near]!r}, " \
                    "which tierd does not stream" if near is not None else ""
                raise InvalidArgument(f"{self.checkpoint.path}: no key {names[0]!r} (the model's "
                                      f"{'parameter' if isinstance(t, nn.Parameter) else 'buffer'}"
                                      f" of shape {tuple(t.shape)}){why}")
            e = entries[key]
            if e.shape != tuple(t.shape):
                raise InvalidArgument(f"{e.file}: key {key!r} has shape {e.shape}; the model's is "
                                      f"{tuple(t.shape)}")
            if not convertible(e.dtype, t.dtype):
                raise InvalidArgument(f"{e.file}: key {key!r} is {e.dtype}; the model's is "
                                      f"{t.dtype}")
            self._key[id(t)] = key
            used.update(by_name[n] for n in names if n in by_name)
        unused = set(entries) - used
        unexpected = sorted(unused - keys.ignored(unused))
        if unexpected:
            raise InvalidArgument(f"{entries[unexpected[0]].file}: key {unexpected[0]!r} is not a "
                                  f"parameter or saved buffer of the model ({len(unexpected)} such "
                                  "keys)")

    def identity(self) -> Dict[str, str]:
        return {"kind": "checkpoint", "digest": self.checkpoint.digest()}

    def follow(self, made) -> None:
        super().follow(made)
        for old, new in made.items():
            if old in self._key:
                self._key[id(new)] = self._key.pop(old)

    def unit_values(self, module, params):
        """Each weight stored in the model's dtype as its span of the file (FileSpan: the daemon
        reads it straight into the unit's chunk); the others as readers that convert it there."""
        def value(p):
            key = self._key[id(p)]
            if self.checkpoint.entries[key].dtype == p.dtype:
                return self.checkpoint.span(key)
            return lambda out: self.checkpoint.read_into(key, out)
        return {id(p): value(p) for p in params}

    def make_resident(self, resident, device):
        made: Dict[int, torch.Tensor] = {}
        self._recompute_unsaved(resident, device, made)
        wanted = []  # (key, the tensor that takes its value)
        with torch.no_grad():
            for t in resident:
                if self.names.saved(t):
                    wanted.append((self._key[id(t)], torch.empty(t.shape, dtype=t.dtype,
                                                                device=device)))
                    _set(t, wanted[-1][1], made)
                elif id(t) not in made and t.device != device:
                    _set(t, t.detach().to(device), made)
        if wanted:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierd-resident")
            self._reading = pool.submit(self._read_resident, wanted)
            pool.shutdown(wait=False)
        return made

    def _read_resident(self, wanted) -> None:
        with torch.no_grad():
            for key, out in wanted:
                if out.device.type == "cpu":
                    self.checkpoint.read_into(key, out.view(-1))
                else:
                    out.copy_(self.checkpoint.read(key))  # converted to out's dtype

    def wait_resident(self) -> None:
        reading, self._reading = self._reading, None
        if reading is not None:
            reading.result()

    def duplicate(self) -> "FromCheckpoint":
        """This source over a duplicate of its checkpoint (Checkpoint.duplicate)."""
        twin = copy.copy(self)
        twin._reading = None
        twin.checkpoint = self.checkpoint.duplicate()
        return twin

    def close(self) -> None:
        if self._reading is not None:  # its reads end before the descriptors close
            concurrent.futures.wait([self._reading])
        self.checkpoint.close()


class FromInit(Source):
    """Weights made by an initialisation: `init(module)` on each unit materialised on a staging
    copy on the CPU, and on each module holding resident tensors, materialised on the device.
    Default: the model's own (own_init) on every module."""

    def __init__(self, model: nn.Module, init: Optional[Init]):
        super().__init__(model)
        self.init = init

    def identity(self) -> Dict[str, str]:
        return {"kind": "init"}

    def _apply(self, module: nn.Module, whole: bool) -> None:
        with torch.no_grad():
            if self.init is not None:
                self.init(module)
                return
            each = own_init(self.model)
            for m in (module.modules() if whole else [module]):
                each(m)

    def check(self, streamed, resident) -> None:
        if self.init is None and not callable(getattr(self.model, "_init_weights", None)):
            for name, m in self.model.named_modules():
                on_meta_here = any(p.is_meta for p in m.parameters(recurse=False))
                if on_meta_here and not hasattr(m, "reset_parameters"):
                    raise InvalidArgument(f"stream_parameters: module {name!r} "
                                          f"({type(m).__name__}) has parameters on meta and no "
                                          "reset_parameters(): give init= to initialise them")

    def unit_values(self, module, params):
        local = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        staged = copy.deepcopy(module).to_empty(device="cpu")
        self._apply(staged, whole=True)
        made = dict(staged.named_parameters(remove_duplicate=False))
        return {id(p): made[local[id(p)]].detach().reshape(-1) for p in params}

    def make_resident(self, resident, device):
        made: Dict[int, torch.Tensor] = {}
        self._recompute_unsaved(resident, device, made)
        owners: Dict[int, nn.Module] = {}
        for t in resident:
            if t.is_meta and id(t) not in made:
                m = self.names.owner[self.names.of[id(t)][0]]
                owners[id(m)] = m
        for m in owners.values():  # each meta tensor made by its first owner, then initialised
            for store in (m._parameters, m._buffers):
                for n, t in list(store.items()):
                    if t is not None and t.is_meta and id(t) not in made:
                        _set(t, torch.empty_like(t, device=device), made)
                        store[n] = made[id(t)]
            self._apply(m, whole=False)
        with torch.no_grad():
            for t in resident:
                if not t.is_meta and t.device != device:
                    _set(t, t.detach().to(device), made)
        return made


def source_for(model: nn.Module, checkpoint: Optional[str], init: Optional[Init]) -> Source:
    """The source stream_parameters takes the weights from: the checkpoint when given; an
    initialisation (init, else the model's own) for a model with tensors on meta; else the
    model's own tensors."""
    if checkpoint is not None:
        if init is not None:
            raise InvalidArgument("stream_parameters: give checkpoint= or init=, not both")
        return FromCheckpoint(model, checkpoint)
    if on_meta(model):
        return FromInit(model, init)
    if init is not None:
        raise InvalidArgument("stream_parameters: init= initialises a model built on the meta "
                              "device; this one has its weights")
    return FromModel(model)
