"""`model.load_state_dict()` on a streamed model: each unit's weights written through the stream.

torch's load_state_dict copies each value into its parameter, and a streamed parameter outside
the window has no bytes to copy into (_guard.py refuses the copy). So a pre-hook on each unit's
module takes the values of the unit's streamed parameters out of the state_dict, checked as torch
checks them (a shape that differs is torch's own "size mismatch" error), and writes them into the
unit's current weights, as gathered() writes what changed inside it: OffloadedAdamW takes them as
its master weights at its next step. Its post-hook takes their keys off the missing list that
torch made for them once they were out. A value for a parameter of a shared base is accepted
when it equals the base's weights (a checkpoint of the whole model) and refused otherwise.
Resident tensors and buffers load as torch loads them. Between steps.
"""
from typing import Any, Callable, Dict, List

import torch

from .._errors import FailedPrecondition
from ._units import Unit, Units
from ._window import Window


class StateDictLoading:
    def __init__(self, units: Units, window: Window, busy: Callable[[], bool]):
        self.units = units
        self.window = window
        self._busy = busy
        self._handles: List[Any] = []
        self._taken: Dict[int, List[str]] = {}  # unit index -> keys taken out, this load

    def install(self) -> None:
        for u in self.units:
            m = u.module
            self._handles.append(m.register_load_state_dict_pre_hook(
                lambda module, *args, u=u: self._pre(u, *args)))
            self._handles.append(m.register_load_state_dict_post_hook(
                lambda module, incompatible, u=u: self._post(u, incompatible)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, u: Unit, state_dict, prefix, local_metadata, strict, missing_keys,
             unexpected_keys, error_msgs) -> None:
        self._taken.pop(u.index, None)  # what an earlier load that raised left
        streamed = {id(p) for p in u.params}
        named = [(prefix + name, p)
                 for name, p in u.module.named_parameters(remove_duplicate=False)
                 if id(p) in streamed and prefix + name in state_dict]
        if not named:
            return
        if self._busy():
            raise FailedPrecondition("stream_parameters: load_state_dict() during a forward or "
                                     "backward, or inside gathered()")
        changed, base = {}, {}
        for key, p in named:
            value = state_dict.pop(key)
            self._taken.setdefault(u.index, []).append(key)
            if not torch.is_tensor(value):
                error_msgs.append(f'While copying the parameter named "{key}", expected '
                                  f"torch.Tensor or Tensor-like object from checkpoint but "
                                  f"received {type(value)}")
                continue
            if tuple(value.shape) != tuple(p.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{value.shape} from checkpoint, the shape in current model "
                                  f"is {p.shape}.")
                continue
            flat = value.detach().to("cpu", p.dtype).reshape(-1)
            (base if u.in_base(p) else changed)[id(p)] = (key, flat)
        if base:
            now = {id(p): w for p, w in self.units.weights(u)}
            for pid, (key, flat) in base.items():
                if not torch.equal(now[pid], flat):
                    error_msgs.append(f"{key}: in a shared base, which is read-only; the value "
                                      "loaded differs from the base's weights")
        if changed:
            with self.window.lock:
                if self.window.in_use(u):
                    raise FailedPrecondition("stream_parameters: load_state_dict() while a unit is "
                                             "in use")
                self.window.evict(u)  # a copy left in the window is stale now
                self.units.write_weights(u, {pid: flat for pid, (_, flat) in changed.items()})
                self.units.point(u)

    def _post(self, u: Unit, incompatible) -> None:
        taken = set(self._taken.pop(u.index, []))
        if taken:
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                            if k not in taken]
