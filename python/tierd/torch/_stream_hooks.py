"""The stream's hooks on the model, and the training state they keep.

Four points, no wrapper class: a forward pre-hook uses the unit (the window fetches it and its
next units); a forward post-hook stops using it and hooks its outputs, whose gradients arriving
mean its backward is next (use it again); an identity autograd Function on its inputs runs when
its backward is done (stop using it, with any recompute whose forward a checkpoint stopped
early); an end-of-backward callback stops what had none. Counts make a module called twice, or
recomputed by activation checkpointing, fetch once.
"""
import enum
from typing import Any, List

import torch

from ._storage import tensors
from ._units import Unit, Units
from ._window import Window


class TrainingState(enum.Enum):
    IDLE = enum.auto()      # forward, or between iterations
    BACKWARD = enum.auto()  # a backward runs: its end-of-backward callback is queued
    GATHERED = enum.auto()  # inside gathered(): the weights are on the CPU, the hooks stand aside


class _Passes:
    """A unit's passes under way that its hooks end: backward passes its inputs' gradients end,
    and recomputes in its backward (which may stop early). The window counts every pass using the
    unit (its slot's refs); these say which of them the hooks are to end."""

    def __init__(self):
        self.backward = 0
        self.recomputes = 0


class StreamHooks:
    def __init__(self, units: Units, window: Window):
        self.units = units
        self.window = window
        self.state = TrainingState.IDLE
        self._handles: List[Any] = []
        self._passes = {u.index: _Passes() for u in units}

    def install(self) -> None:
        for u in self.units:
            self._handles.append(u.module.register_forward_pre_hook(
                lambda m, args, u=u: self._pre_forward(u, args)))
            self._handles.append(u.module.register_forward_hook(
                lambda m, args, out, u=u: self._post_forward(u, out)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def in_backward(self) -> bool:
        return self.state is TrainingState.BACKWARD

    def busy(self) -> bool:
        """Whether a forward or backward uses a unit now, or the weights are gathered."""
        return self.state is not TrainingState.IDLE or self.window.any_in_use()

    def _use(self, u: Unit, traced: bool) -> None:
        self.window.use(u, traced, self.in_backward)

    def _unuse(self, u: Unit) -> None:
        self.window.unuse(u, self.in_backward)

    # ---- forward ----

    def _pre_forward(self, u: Unit, args):
        if self.state is TrainingState.GATHERED:
            return None  # the weights are in place on the CPU: a forward just reads them
        # A forward of a unit in backward is its recompute (a checkpoint around it), once its
        # backward has begun; any other forward while "in backward" means the last backward
        # raised before its end.
        recompute = self.in_backward and self._passes[u.index].backward > 0
        if self.in_backward and not recompute:
            self._recover()
        self._use(u, traced=recompute or torch.is_grad_enabled())
        if recompute:
            self._passes[u.index].recomputes += 1
        if recompute or not torch.is_grad_enabled():
            return None
        marked_args = [a for a in args if torch.is_tensor(a) and a.requires_grad]
        if not marked_args:
            return None
        marked = _AfterBackward.apply(_Token(self, u), *marked_args)
        marked = list(marked) if len(marked_args) > 1 else [marked]
        out = []
        for a in args:
            if torch.is_tensor(a) and a.requires_grad:
                out.append(marked.pop(0))
            else:
                out.append(a)
        return tuple(out)

    def _post_forward(self, u: Unit, output):
        if self.state is TrainingState.GATHERED:
            return None
        if not self.in_backward and torch.is_grad_enabled():
            fired = [False]

            def before_backward(grad, u=u, fired=fired):
                if not fired[0]:
                    fired[0] = True
                    self._before_backward(u)
                return grad
            for t in tensors(output):
                if t.requires_grad:
                    t.register_hook(before_backward)
        if self.in_backward and self._passes[u.index].recomputes > 0:
            self._passes[u.index].recomputes -= 1
        self._unuse(u)
        return None

    # ---- backward ----

    def _before_backward(self, u: Unit) -> None:
        if not self.in_backward:
            self.state = TrainingState.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._use(u, traced=True)
        self._passes[u.index].backward += 1

    def _after_backward(self, u: Unit) -> None:
        if self._passes[u.index].backward > 0:
            self._passes[u.index].backward -= 1
            self._unuse(u)
        self._end_recomputes(u)

    def _end_recomputes(self, u: Unit) -> None:
        """Releases u's recomputes whose forward never ended: torch 2's non-reentrant checkpoint
        stops a recompute once it has what backward needs, before the module's forward hook."""
        while self._passes[u.index].recomputes > 0:
            self._passes[u.index].recomputes -= 1
            self._unuse(u)

    def _end_backward(self) -> None:
        """After every backward: releases what no input's gradient released (a unit whose
        inputs need none), ends the traced iteration."""
        with self.window.lock:
            for u in self.units:
                while self._passes[u.index].backward > 0:
                    self._passes[u.index].backward -= 1
                    self._unuse(u)
                self._end_recomputes(u)
            self.window.evict_unused()
            self.state = TrainingState.IDLE
            self.window.trace.end_iteration()
        self.units.check_frozen()

    def _recover(self) -> None:
        """After a backward that raised: nothing it fetched stays, its iteration is not traced."""
        with self.window.lock:
            self._passes = {u.index: _Passes() for u in self.units}
            self.window.evict_all()
            self.state = TrainingState.IDLE
            self.window.trace.abandon_iteration()


class _Token:
    """What the identity Function carries: the unit whose inputs it marks."""

    def __init__(self, hooks: StreamHooks, unit: Unit):
        self.hooks = hooks
        self.unit = unit


class _AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs: its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, token, *inputs):
        ctx.token = token
        out = tuple(t.view_as(t) for t in inputs)
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.token.hooks._after_backward(ctx.token.unit)
        return (None,) + grads
