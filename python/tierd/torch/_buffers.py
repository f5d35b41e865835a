"""A bucket's buffers: where its gradients and a step's new weights lie, and what holds them.

A bucket reads and writes four views: `grad_ext` (the gradients, then one extra element per
parameter for the sharded optimizer) with `grad` its values, and `out_ext` (a step's new weights,
then the extras) with `out` its values. Two kinds of buffers give them, with the same verbs:

- HostBuffers: tensors of this process (pinned when the model is on a GPU), made once and never
  let go: holding them is having them, and putting them aside changes nothing;
- RangeBuffers: a streamed range's gradient chunk and next version (_ranges.StreamRange), held
  while a step uses them; the views are None while not held.

`grads_on_device` (DeviceLanes.place's, between steps): the bucket is stepped by the optimizer's
device lane, so a range holds its gradients in the daemon's device tier (where the kernels read
them without crossing the link); this process's buffers stay where they are.

hold_grads() and hold_next() make the views writable (a range's chunks held); hold_kept_grads()
holds again only gradients put aside and kept; put_aside() lets the step's holds go with their
contents kept; end_step() lets whatever is held go, at a step's end; gradient_taken() follows
a parameter's gradient taken into `grad` (a streamed one leaves the device).
"""
from typing import Optional, Union

import torch

from ._ranges import StreamRange

__all__ = ["Buffers", "HostBuffers", "RangeBuffers"]


class HostBuffers:
    pages = False  # nothing to give back early: the buffers are this process's
    grads_on_device = False  # not followed: the buffers are made once

    def __init__(self, numel: int, k: int, dtype: torch.dtype, pin: bool):
        self.grad_ext = torch.zeros(numel + k, dtype=dtype, pin_memory=pin)
        self.out_ext = torch.zeros(numel + k, dtype=dtype, pin_memory=pin)
        self.grad = self.grad_ext[:numel]
        # The weights as the optimizer last left them in the model (what it wrote after a step,
        # or read at the start): a weight that differs was changed by the caller.
        self.out = self.out_ext[:numel]

    def hold_grads(self) -> None:
        pass  # always held

    def hold_kept_grads(self) -> Optional[torch.Tensor]:
        return self.grad

    def hold_next(self) -> None:
        pass  # always held

    def put_aside(self, free: bool, weights: bool = True) -> None:
        pass  # nothing to let go

    def end_step(self) -> None:
        pass  # kept: `out` is the weights as the optimizer left them

    def gradient_taken(self, i: int) -> None:
        pass  # the parameter's .grad stays, as torch leaves it


class RangeBuffers:
    """A streamed range's chunks as a bucket's buffers: `grad` views its gradient chunk from the
    step's first gradient until put aside or the step's end; `out` views its next version from
    the launch until put aside or the step's end."""

    def __init__(self, rng: StreamRange):
        self._range = rng
        self._numel = sum(p.numel() for p in rng.info.params)
        self.grads_on_device = False
        self.pages = rng.info.pages
        self.grad_ext = self.grad = None
        self.out_ext = self.out = None

    def hold_grads(self) -> None:
        self._placed_elsewhere()
        if self.grad is None:
            self._grads(self._range.grads(on_device=self.grads_on_device))

    def hold_kept_grads(self) -> Optional[torch.Tensor]:
        self._placed_elsewhere()
        if self.grad is None:
            self._grads(self._range.grads(kept_only=True, on_device=self.grads_on_device))
        return self.grad

    def _placed_elsewhere(self) -> None:
        """Gradients held in the device tier for a bucket placed on the host lane since: their
        views go, and the range holds them again in the host."""
        if self.grad is not None and not self.grads_on_device and self._range.grads_on_device:
            self.grad_ext = self.grad = None

    def _grads(self, ext: Optional[torch.Tensor]) -> None:
        self.grad_ext = ext
        self.grad = None if ext is None else ext[:self._numel]

    def hold_next(self) -> None:
        if self.out is None:
            self.out_ext = self._range.next()
            self.out = self.out_ext[:self._numel]

    def put_aside(self, free: bool, weights: bool = True) -> None:
        self.grad_ext = self.grad = None
        if weights:
            self.out_ext = self.out = None
        self._range.put_aside(free, weights)

    def end_step(self) -> None:
        self.out_ext = self.out = None
        self.grad_ext = self.grad = None
        self._range.end_step()

    def gradient_taken(self, i: int) -> None:
        self._range.gradient_sent(i)  # it leaves the device: dropped there, counted


Buffers = Union[HostBuffers, RangeBuffers]
