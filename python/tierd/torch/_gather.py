"""A stream's weights gathered in the process: gathered() (every streamed parameter holding its
weights on the CPU for a while, edits kept) and save_pretrained() (the weights written as a
Hugging Face checkpoint, one unit in memory at a time).

Both work between steps, over the stream's rooms as ParameterStream hands them in: the units and
their chunks, the window (whose copies go first, and whose lock keeps the units still), the hooks
(whose training state says whether a forward or backward is running) and the shared base (whose
check must have passed before its weights are handed out).
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .._errors import FailedPrecondition
from . import _safetensors
from ._hf_keys import KeyNames
from ._progress import bar
from ._stream_hooks import StreamHooks, TrainingState
from ._units import Unit, Units
from ._window import Window


class Gathered:
    """The context gathered() returns (see ParameterStream.gathered)."""

    def __init__(self, units: Units, window: Window, hooks: StreamHooks, base,
                 check_open: Callable[[], None], stream):
        self.units = units
        self.window = window
        self.hooks = hooks
        self.base = base  # the shared base (_shared_base.SharedBase), if any
        self.check_open = check_open
        self.stream = stream  # what `with stream.gathered() as s` binds
        self.before: List[Tuple[Unit, List[Tuple[torch.Tensor, torch.Tensor]]]] = []

    def __enter__(self):
        self.check_open()
        if self.base is not None:
            self.base.checked()
        if self.hooks.busy():
            raise FailedPrecondition("stream_parameters: gathered() during a forward or backward, "
                                     "or inside another gathered()")
        for u in self.units:
            self.window.evict(u)
            weights = self.units.weights(u)
            self.before.append((u, weights))
            with torch.no_grad():
                for p, w in weights:
                    p.data = w.clone().view(p.shape)
        self.hooks.state = TrainingState.GATHERED
        return self.stream

    def __exit__(self, *exc):
        self.hooks.state = TrainingState.IDLE
        units = self.units
        for u, weights in self.before:
            changed = {}
            for p, w in weights:
                now = p.detach().reshape(-1)
                if now.dtype != w.dtype or now.numel() != w.numel():
                    raise FailedPrecondition("stream_parameters: a streamed parameter's dtype or "
                                             "shape changed inside gathered()")
                if not torch.equal(now, w):
                    changed[id(p)] = now.clone()
            try:
                units.write_weights(u, changed)
            except ValueError:
                raise FailedPrecondition(f"stream_parameters: a parameter of unit {u.name!r} was "
                                         "changed inside gathered(), but it is in the shared base "
                                         f"{self.base.name!r}, which is read-only; its weights "
                                         "stay as they were") from None
            finally:
                units.point(u)
        self.before = []


def save_pretrained(model: nn.Module, units: Units, window: Window, directory: str,
                    max_shard_size, progress: Optional[bool]) -> List[str]:
    """The model's weights as safetensors shards with an index, and its config (see
    ParameterStream.save_pretrained; `progress`: _progress.py's). REQUIRES: between steps, the
    shared base checked."""
    size = _safetensors.parse_size(max_shard_size)
    entries, seen = [], set()
    tensors: Dict[str, torch.Tensor] = {}
    keys = KeyNames(model)  # the keys save_pretrained writes
    for name, t in base_state(model).items():
        if id(t) in seen:
            continue  # tied: written once
        seen.add(id(t))
        key = keys.to_checkpoint(name)
        entries.append((key, tuple(t.shape), t.dtype))
        tensors[key] = t
    cached: Dict[int, Dict[int, torch.Tensor]] = {}  # the unit being written

    def read(name: str) -> torch.Tensor:
        t = tensors[name]
        u = units.unit_of(t)
        if u is None:
            return t.detach().to("cpu", copy=True)
        if u.index not in cached:
            cached.clear()
            cached[u.index] = {id(p): w for p, w in units.weights(u)}
        return cached[u.index][id(t)].view(t.shape)

    total = sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in entries)
    with window.lock, bar("Saving weights", total, progress) as done:
        written = _safetensors.write(directory, entries, read, size, done=done)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(directory)
    return written


def base_state(model: nn.Module) -> Dict[str, torch.Tensor]:
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
