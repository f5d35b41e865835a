"""OffloadedAdamW's gradient intake (overlap_backward): gradients taken as backward produces them.

A hook on each trainable parameter copies its gradient into its bucket (off the GPU on a side
stream; a streamed parameter's straight into its range's gradient chunk, summed over the passes
of accumulation). A bucket is complete when every gradient it awaits has come; a complete bucket
goes to the hand-over thread, which waits for its copies and gives it to the optimizer (the one
event this room raises: `ready`), so that autograd's thread goes on with backward. An
end-of-backward callback waits for what was handed over (`settle`).
"""
import concurrent.futures
import threading
from typing import Any, Callable, Dict, List

import torch

from .._errors import FailedPrecondition
from ._buckets import Bucket, StreamBucket
from ._layout import BucketLayout
from ._storage import grad_accumulator


class GradientIntake:
    def __init__(self, layout: BucketLayout, accumulation_steps: int, sharded: bool,
                 prepare: Callable[[], None], admit: Callable[[Bucket], None],
                 ready: Callable[[Bucket], None]):
        """`prepare`: called at each gradient (the optimizer readies the step at the first);
        `admit`: called before a streamed bucket's first gradient of a step is taken into its
        chunk (the optimizer may wait there for room); `ready`: called on the hand-over thread
        with each complete bucket, in completion order."""
        self._layout = layout
        self.accumulation_steps = accumulation_steps  # set between steps
        self._sharded = sharded  # the ranks' buffers are summed: a missing gradient is zeros
        self._prepare = prepare
        self._admit = admit
        self._ready = ready
        self.hooks: Dict[int, Any] = {}
        self._counts: Dict[int, int] = {}  # backward passes that gave each parameter a gradient
        self._handing = None  # the hand-over thread (made at the first complete bucket)
        self._handing_made = threading.Lock()
        self._handed: List[Any] = []  # its work of this step
        self._settle_queued = False  # an end-of-backward callback waits for it
        self._stream = None  # the side stream of copies off the GPU

    @torch.enable_grad()
    def install(self, param_groups: List[Dict[str, Any]]) -> None:
        """Hooks every parameter in the groups that requires a gradient and has no hook yet."""
        for g in param_groups:
            for p in g["params"]:
                if not p.requires_grad or id(p) in self.hooks:
                    continue
                key = id(p)
                if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                    self.hooks[key] = p.register_post_accumulate_grad_hook(
                        lambda param, key=key: self._on_grad(key))
                else:  # torch 1.13: a hook on the parameter's gradient accumulator
                    acc = grad_accumulator(p)
                    handle = acc.register_hook(lambda *_, key=key: self._on_grad(key))
                    self.hooks[key] = (acc, handle)

    def expect(self) -> None:
        """The step's bookkeeping: how many gradients each bucket awaits (its live parameters
        that require one and are hooked); a bucket of frozen parameters is complete at once."""
        for b in self._layout.active():
            trainable = [p for i, p in enumerate(b.params) if b.live[i] and p.requires_grad]
            b.this_step.expected = sum(1 for p in trainable if id(p) in self.hooks)
            if not trainable:  # frozen: nothing to wait for (nor to hold later buckets up)
                self.complete(b)

    def _on_grad(self, key: int) -> None:
        self._prepare()
        if not self._settle_queued:  # backward's end waits for what it handed over
            self._settle_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        place = self._layout.place(key)
        if place is None:
            return
        b, i = place
        self._counts[key] = self._counts.get(key, 0) + 1
        count = self._counts[key]
        if count > self.accumulation_steps:
            # Its bucket may be stepped already: this gradient would be lost without a word.
            raise FailedPrecondition(
                f"OffloadedAdamW: a parameter of shape {tuple(b.params[i].shape)} got its "
                f"gradient {count} times before step(), but accumulation_steps is "
                f"{self.accumulation_steps}: with overlap_backward its bucket is stepped after "
                "that many backward passes. Set accumulation_steps to the backward passes of "
                "a step (gradient accumulation), or call step() after each (after a backward "
                "that raised, zero_grad() or step() first)")
        now = b.this_step
        if isinstance(b, StreamBucket):
            # Each pass's gradient leaves the device at once, summed into the bucket's.
            if now.launched:
                return
            if count == 1 and b.buffers.grad is None:  # the bucket's first this step
                self._admit(b)
            self.copy_grad(b, i, add=count > 1)
            if count < self.accumulation_steps:
                return
        else:
            if count < self.accumulation_steps or now.launched or now.got[i]:
                return
            self.copy_grad(b, i)
        now.arrived += 1
        if now.arrived < now.expected:
            return
        self.complete(b)  # the rest: frozen parameters that still hold a gradient
        self._handed.append(self._hand_over_thread().submit(self._ready, b))

    def _hand_over_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._handing_made:
            if self._handing is None:
                self._handing = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="tierd-hand-over")
            return self._handing

    def submit(self, fn: Callable[[], None]) -> None:
        """Runs fn on the hand-over thread, after what was handed over so far; from any thread.
        Not waited for by settle(): fn keeps its own errors."""
        self._hand_over_thread().submit(fn)

    def _end_backward(self) -> None:
        self._settle_queued = False
        self.settle()

    def settle(self) -> None:
        """Waits for the buckets handed over during backward; raises the first error of theirs."""
        handed, self._handed = self._handed, []
        error = None
        for f in handed:
            try:
                f.result()
            except BaseException as e:  # noqa: B036 (raised below, once all have settled)
                error = error or e
        if error is not None:
            raise error

    def take_rest(self, comm) -> List[Bucket]:
        """At step(): the gradients not handed over during backward, taken now (sharded over
        `comm`: summed into their owners). This rank's buckets still to step, flagged, their
        copies done."""
        todo = []
        for b in self._layout.active():
            if b.this_step.launched:
                continue
            self.complete(b)
            todo.append(b)
        if comm is not None:
            comm.reduce_ready(self._layout.active(), force=True)
            todo = list(comm.reduced([b for b in todo if b.slot is not None], wait=True))
        todo = [b for b in todo if b.flag()]
        for b in todo:
            if b.this_step.event is not None:
                b.this_step.event.synchronize()
        return todo

    def complete(self, b: Bucket) -> None:
        """Takes the gradients of b's live parameters not taken yet: those that have one now
        (torch steps a parameter whose .grad is not None), zeros for the others when sharded
        (the ranks' buffers are summed)."""
        now = b.this_step
        if now.complete:
            return
        for i in range(len(b.sizes)):
            if now.got[i] or not b.live[i]:
                continue
            if b.params[i].grad is not None:
                self.copy_grad(b, i)
            elif self._sharded:
                b.buffers.hold_grads()
                b.slice(b.buffers.grad, i).zero_()
        now.has = list(now.got)
        now.complete = True

    def copy_grad(self, b: Bucket, i: int, add: bool = False) -> None:
        """Takes p.grad into the bucket's gradients (`add`: summed into what is there)."""
        b.buffers.hold_grads()
        p, dst = b.params[i], b.slice(b.buffers.grad, i)
        b.this_step.got[i] = True
        g = p.grad.detach().reshape(-1)
        if add:
            if b.this_step.event is not None:
                b.this_step.event.synchronize()
            dst.add_(g.to(dst.device))
        elif p.grad.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(p.device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(stream):
                dst.copy_(g, non_blocking=True)
                p.grad.record_stream(stream)
                b.this_step.event = torch.cuda.Event()
                b.this_step.event.record(stream)
        else:
            dst.copy_(g)
        b.buffers.gradient_taken(i)

    def end_step(self) -> None:
        self._counts.clear()
        # A backward that raised never ran its end callback: the next one queues its own.
        self._settle_queued = False

    def close(self) -> None:
        """Removes the hooks and ends the hand-over thread (settle first)."""
        if self._handing is not None:
            self._handing.shutdown()
            self._handing = None
        for h in self.hooks.values():
            (h[1] if isinstance(h, tuple) else h).remove()
        self.hooks = {}
