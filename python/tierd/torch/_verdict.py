"""The verdict on a step's gradients: unscaled, skipped when not finite, clipped to a global norm,
exactly as GradScaler.unscale_ and clip_grad_norm_ would; and whether buckets stepped during
backward speculatively (before the global norm was known) were stepped as the verdict says.

A speculative bucket is stepped as if the step would neither clip nor skip, at the last step's
loss scale; the speculation holds when the norm says exactly that (a clip coefficient of exactly
1, a finite norm, the same scale). Otherwise the optimizer abandons what it stepped and steps
every bucket again from the state's first version.
"""
import math
from typing import Any, Dict, List, Optional

import torch

from ._buckets import Bucket
from ._shard import Comm


class Verdict:
    def __init__(self, max_grad_norm: Optional[float], skip_nonfinite: bool, speculate: bool,
                 comm: Optional[Comm]):
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.speculate = speculate  # buckets are stepped during backward despite the checks
        self.spec_scale = 1.0       # the loss scale speculative buckets assume: the last step's
        self.order: Optional[List[torch.Tensor]] = None  # grad_norm's, when not the groups'
        self._comm = comm

    @property
    def checks(self) -> bool:
        """Whether the gradients are checked before they are applied (clip or skip)."""
        return self.max_grad_norm is not None or self.skip_nonfinite

    def steps_early(self) -> bool:
        """Whether buckets may be stepped during backward (nothing to check, or speculating)."""
        return self.speculate or not self.checks

    @staticmethod
    def inverse(grad_scale: float) -> torch.Tensor:
        """As GradScaler.unscale_: the fp32 reciprocal of the scale."""
        return torch.tensor(grad_scale, dtype=torch.float64).reciprocal().float()

    def clip_coefficient(self, norm: torch.Tensor) -> torch.Tensor:
        # As clip_grad_norm_ computes it.
        return torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)

    def speculation_holds(self, norm: torch.Tensor, grad_scale: float) -> bool:
        """Whether the buckets stepped during backward were stepped as the whole step's gradients
        (of global norm `norm`, unscaled) say they must be: at this loss scale, neither clipped
        nor skipped."""
        if grad_scale != self.spec_scale or not math.isfinite(float(norm)):
            return False  # another scale; or skipped, or clipped by a non-finite norm
        return self.max_grad_norm is None or float(self.clip_coefficient(norm)) == 1.0

    def skips(self, norm: torch.Tensor) -> bool:
        return self.skip_nonfinite and not math.isfinite(float(norm))

    def grad_norm(self, param_groups: List[Dict[str, Any]], buckets: List[Bucket],
                  inv: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As clip_grad_norm_: each gradient's 2-norm (of the parameters that have one), then the
        norm of those (of the gradients times `inv` when given, as unscaling them would make).
        In the parameter groups' order (as clip_grad_norm_ over the model's parameters), or
        `order` where it is given (a Trainer's groups, decayed and not, are in another order than
        its model's parameters), not the buckets': the norm is one float sum whatever the
        bucketing. Sharded: every rank's norms
        gathered, then the same sum, so that it is the one process's norm bit for bit."""
        every = self.order if self.order is not None else \
            [p for g in param_groups for p in g["params"]]
        order = {id(p): k for k, p in enumerate(every)}
        keyed = []
        for b in buckets:
            if not any(b.this_step.has):
                continue
            # On the CPU whatever the gradients' place (a device bucket's may be in device
            # memory), so that the norms stack.
            keyed += [(order.get(id(b.params[i]), len(order)),
                       torch.norm(values if inv is None else values * inv, 2.0).to("cpu"))
                      for i, values in b.slices(b.buffers.hold_kept_grads()) if b.this_step.has[i]]
            b.grads_aside()  # one bucket's gradients in memory at a time
        if self._comm is not None:  # every rank's norms, then the same sum as below
            keyed = self._comm.gather_norms(keyed)
        norms = [n for _, n in sorted(keyed, key=lambda kv: kv[0])]
        if not norms:
            return torch.zeros(())
        return torch.norm(torch.stack(norms), 2.0)

    def apply(self, param_groups: List[Dict[str, Any]], buckets: List[Bucket], grad_scale: float,
              norm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Unscales the buckets' gradients, then clips them unless the step is to be skipped;
        returns the global norm (of the unscaled gradients; `norm` when known already), None
        when nothing is checked."""
        if grad_scale != 1.0:
            self.scale(buckets, self.inverse(grad_scale))
        if not self.checks:
            return None
        if norm is None:
            norm = self.grad_norm(param_groups, buckets)
        if not self.skips(norm) and self.max_grad_norm is not None:
            self.scale(buckets, self.clip_coefficient(norm))
        return norm

    @staticmethod
    def scale(buckets: List[Bucket], factor: torch.Tensor) -> None:
        """Multiplies the buckets' gradients by `factor` (unscale, or clip)."""
        for b in buckets:
            grad = b.buffers.hold_kept_grads()
            if grad is not None:
                grad.mul_(factor)
                del grad
                b.grads_aside()
