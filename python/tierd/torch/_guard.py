"""A streamed parameter outside the device window: its shape without its bytes, guarded.

Outside the window a streamed parameter's storage is empty (_storage.py): torch does not check a
tensor's storage against its size, so reading it (`p.norm()`, `p.data.sum()`, `state_dict()`
values, `copy_`) would read freed memory and die of a signal. `guard(p)` makes p a
`StreamedParameter` (the same object, its class swapped), whose every torch operation is checked
first: while its storage is empty, an operation that only reads metadata (shape, dtype, hooks,
`requires_grad`, the storage handle the window resizes) goes on; one that makes a view of it
(`detach`, `.data`, `view`, `t`) gives a view guarded the same way; anything else raises a
RuntimeError that says what to do. Inside the window (the storage holds the weights) nothing is
checked beyond one look at the storage's size, and the results are plain tensors, as before.
"""
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass

from .._errors import FailedPrecondition

T = torch.Tensor

# Read nothing of the elements: metadata, hooks, the storage handle, and what sets them.
_METADATA = {
    T.size, T.stride, T.dim, T.numel, T.nelement, T.element_size, T.storage_offset,
    T.untyped_storage, T.data_ptr, T.is_contiguous, T.is_floating_point, T.is_complex,
    T.is_signed, T.get_device, T.requires_grad_, T.register_hook, T.__len__,
    getattr(T, "register_post_accumulate_grad_hook", T.register_hook),
    torch.is_floating_point, torch.is_complex, torch.numel,
    # A new tensor of its shape and dtype: nothing of its elements is read.
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like,
    torch.randn_like, T.new_empty, T.new_zeros, T.new_ones, T.new_full, T.new_tensor,
}
for _name in ("shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn",
              "is_cuda", "is_meta", "is_cpu", "layout", "ndim", "names", "_version",
              "is_sparse", "is_quantized", "is_nested", "_base", "_grad_fn", "output_nr"):
    _descriptor = getattr(T, _name, None)
    if hasattr(_descriptor, "__get__"):
        _METADATA.add(_descriptor.__get__)
    if hasattr(_descriptor, "__set__"):
        _METADATA.add(_descriptor.__set__)
_METADATA.add(T.data.__set__)  # the stream points a parameter at its weights
if hasattr(T, "storage"):
    _METADATA.add(T.storage)

if hasattr(torch, "_has_compatible_shallow_copy_type"):  # Module._apply asks it
    _METADATA.add(torch._has_compatible_shallow_copy_type)


def _unchanged(func, t: T, args, kwargs) -> bool:
    """Whether a conversion returns t itself (it reads nothing then): `to` to its own device
    and dtype without copy=True (what Module.to() does to a model already there), `cpu()` on the
    CPU, `contiguous()` of a contiguous tensor, `float()` of a float32 one."""
    if func is T.to:
        kwargs = dict(kwargs)
        copy = kwargs.pop("copy", False)
        device, dtype, _, fmt = torch._C._nn._parse_to(*args[1:], **kwargs)
        return not copy and fmt is None and (device is None or _same(device, t.device)) and \
            (dtype is None or dtype == t.dtype)
    if func is T.cpu:
        return t.device.type == "cpu"
    if func is T.contiguous:
        return t.is_contiguous()
    same_dtype = {T.float: torch.float32, T.half: torch.float16, T.bfloat16: torch.bfloat16,
                  T.double: torch.float64}
    return func in same_dtype and t.dtype == same_dtype[func]


def _same(device, where: torch.device) -> bool:
    """Whether `to(device)` leaves a tensor on `where` where it is: "cpu:0" (accelerate's device
    of a CPU process) is the CPU, "cuda" the current CUDA device."""
    device = torch.device(device)
    if device.type != where.type:
        return False
    if device.type == "cpu":
        return True
    if device.index is None:  # the current device of its kind, where torch says which
        current = getattr(getattr(torch, device.type, None), "current_device", None)
        return current is not None and current() == where.index
    return device.index == where.index


# Views of the same storage: guarded as their base is.
_VIEWS = {T.detach, T.data.__get__, T.view, T.view_as, T.t, T.T.__get__, T.transpose,
          T.permute, T.expand, T.expand_as, T.narrow, T.unsqueeze, T.squeeze, T.as_strided,
          torch.t, torch.transpose, torch.permute, torch.narrow}


def _tensors(values) -> Iterator[Any]:
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from v
        else:
            yield v


def _released(t: Any) -> bool:
    """Whether t is a guarded tensor whose storage holds nothing now (outside the window)."""
    return isinstance(t, _Guarded) and t.numel() > 0 and t.untyped_storage().nbytes() == 0


class _Guarded:
    """The check, shared by StreamedParameter and its views (see the module's text)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with DisableTorchFunctionSubclass():
            out = [t for t in _tensors(list(args) + list(kwargs.values())) if _released(t)]
            if not out or func in _METADATA:
                return func(*args, **kwargs)
            if args and args[0] is out[0] and _unchanged(func, out[0], args, kwargs):
                return args[0]
            if func in _VIEWS:
                result = func(*args, **kwargs)
                return result.as_subclass(GuardedView) if isinstance(result, T) else result
            if func in (T.__repr__, T.__format__):  # print(p), f"{p}"
                t = out[0]
                return (f"tensor(<streamed by tierd: outside the device window>, "
                        f"size={tuple(t.shape)}, dtype={t.dtype})")
        t = out[0]
        name = getattr(func, "__name__", None) or str(func)
        raise FailedPrecondition(
            f"tierd.torch: {name}() on a streamed parameter of shape {tuple(t.shape)} and "
            f"{t.dtype} outside the device window: its weights are in the daemon, not in "
            "this tensor. Read or change them inside stream.gathered(), save them with "
            "stream.save_pretrained(), load them with model.load_state_dict(); the model's "
            "forward runs inside the window")


class StreamedParameter(_Guarded, nn.Parameter):
    """A streamed nn.Parameter (see the module's text)."""


class GuardedView(_Guarded, torch.Tensor):
    """A view of a streamed parameter made outside the window."""


def guard(p: nn.Parameter) -> None:
    """Makes p a StreamedParameter in place (the same object; its hooks, its place in modules and
    optimizers kept). Only a plain nn.Parameter: a subclass of another library is left as it
    is."""
    if type(p) is nn.Parameter:
        p.__class__ = StreamedParameter


def unguard(p: nn.Parameter) -> None:
    if type(p) is StreamedParameter:
        p.__class__ = nn.Parameter
