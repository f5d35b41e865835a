"""Tensors over tierd memory and over storage that comes and goes: the lowest room of tierd.torch.

A streamed parameter keeps its shape while its storage is resized to nothing and back, so the
helpers here speak of storage, not of tensors: resize, test for empty, find a parameter's
gradient accumulator while it has none. `STEPPED_DTYPES` is the one list of the dtypes the
optimizer steps (and so the dtypes a streamed unit may hold), with their C ABI codes.
"""
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.utils.dlpack

from .. import _abi
from ..client import Acquisition

# The dtypes OffloadedAdamW steps, in the order a unit lays them out, with the C ABI's codes.
STEPPED_DTYPES = {torch.float32: _abi.FLOAT32, torch.bfloat16: _abi.BFLOAT16,
                  torch.float16: _abi.FLOAT16}


def dl_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32": the name the views take."""
    return str(dtype).replace("torch.", "")


def as_tensor(acquisition: Acquisition, i: int, dtype: torch.dtype = torch.uint8,
              shape: Optional[List[int]] = None, offset: int = 0) -> torch.Tensor:
    """A torch tensor viewing chunk i of an acquisition without a copy (DLPack): CPU memory for a
    host chunk, CUDA memory for a device chunk. The chunk cannot be released while the tensor (or
    any view of its storage) lives."""
    return torch.utils.dlpack.from_dlpack(acquisition.dlpack(i, dl_name(dtype), shape, offset))


def range_view(view: torch.Tensor, r) -> torch.Tensor:
    """A unit's range r's elements (values, then extras) in a uint8 view of a whole chunk."""
    return view[r.offset:r.offset + r.nbytes].view(r.dtype)


def end_to_end(tensors: Sequence[torch.Tensor]) -> Tuple[List[int], List[int], int]:
    """Tensors laid end to end, flat: (each one's elements, each one's offset, the total)."""
    sizes = [t.numel() for t in tensors]
    offsets, n = [], 0
    for size in sizes:
        offsets.append(n)
        n += size
    return sizes, offsets, n


def storage(t: torch.Tensor):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def resize(t: torch.Tensor, elements: int) -> None:
    """Gives flat tensor t's storage room for `elements` (0: frees it); t's views see it."""
    st = storage(t)
    if hasattr(t, "untyped_storage"):
        st.resize_(elements * t.element_size())
    else:
        st.resize_(elements)


def storage_empty(t: torch.Tensor) -> bool:
    st = storage(t)
    return (st.nbytes() if hasattr(st, "nbytes") else st.size() * t.element_size()) == 0


def grad_accumulator(p: torch.Tensor):
    """p's AccumulateGrad node (the hook point for its gradient on torch < 2.1). A streamed
    parameter outside the window has no storage for the view that finds it: it gets room for a
    moment (no copy, no read)."""
    if not storage_empty(p) or p.numel() == 0:
        return p.expand_as(p).grad_fn.next_functions[0][0]
    resize(p, p.storage_offset() + p.numel())
    try:
        return p.expand_as(p).grad_fn.next_functions[0][0]
    finally:
        resize(p, 0)


def tensors(output) -> Iterator[torch.Tensor]:
    """Every tensor in a module's output (nested tuples, lists and dicts)."""
    if torch.is_tensor(output):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from tensors(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from tensors(o)
