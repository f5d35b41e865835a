"""One step of OffloadedAdamW, from its first gradient to the new weights in the model.

optimizer.py is the optimizer's face: its arguments, what its user reads and sets, its groups and
its state. This room decides when each part of a step happens, over the rooms below it: the intake
hands over complete buckets during backward (_intake), the verdict unscales, clips, skips or
rolls back (_verdict), buckets are launched into the client library's step and given back early
(_release), sharded buckets are reduced and broadcast (_shard), and the new weights are written
back into the model (_buckets.write_back). The kernels and the state's I/O run in the client
library, which carries out what is decided here and decides nothing of a step itself.
"""
import enum
import math
import time
from typing import Any, Callable, Dict, List, Optional

from .._errors import FailedPrecondition, InvalidArgument
from ._buckets import Bucket, write_back
from ._intake import GradientIntake
from ._layout import BucketLayout
from ._release import EarlyRelease, Launcher
from ._shard import Comm
from ._state import OptimizerState
from ._verdict import Verdict


class StepPhase(enum.Enum):
    IDLE = enum.auto()       # between steps: the groups may change
    GRADIENTS = enum.auto()  # the step's gradients are arriving: its buckets are fixed
    STEPPING = enum.auto()   # the library's step is begun: buckets are being stepped


class Stepper:
    """The steps of one optimizer. `groups` gives the optimizer's param_groups as they are now,
    `overlap` whether gradients are taken during backward (overlap_backward, read at each use).
    Its figures, as the optimizer shows them: last_grad_norm, last_stats, skipped_steps,
    rolled_back_steps."""

    def __init__(self, groups: Callable[[], List[Dict[str, Any]]], overlap: Callable[[], bool],
                 layout: BucketLayout, state: OptimizerState, verdict: Verdict,
                 comm: Optional[Comm], accumulation_steps: int):
        self.phase = StepPhase.IDLE
        self.last_grad_norm: Optional[float] = None
        self.last_stats: Dict[str, float] = {}
        self.skipped_steps = 0
        self.rolled_back_steps = 0
        self._groups = groups
        self._overlap = overlap
        self._layout = layout
        self._state = state
        self._verdict = verdict
        self._comm = comm
        self._pending_copy = None  # the last step's copies into GPU weights
        self._early = 0  # buckets given to the optimizer during this step's backward
        self.intake = GradientIntake(layout, accumulation_steps, comm is not None,
                                     self._prepare, self._admit, self._hand_over)
        self._release: Optional[EarlyRelease] = None
        self._launcher: Optional[Launcher] = None
        if comm is None:  # sharded, a rank's buckets are broadcast from `out` at the end
            self._release = EarlyRelease(state.wait, lambda: self._launcher.room_made())
            self._launcher = Launcher(self._release, self._launch_early, self.intake.submit)
        self.install_hooks()

    # ---- between steps ----

    def install_hooks(self) -> None:
        if self._overlap():  # every parameter that requires a gradient now
            self.intake.install(self._groups())

    def settle(self) -> None:
        """Waits for the gradients handed over so far to be taken in."""
        self.intake.settle()

    def between_steps(self, what: str) -> None:
        """Refuses `what` during a step; takes in the groups as they are now."""
        self.settle()
        if self.phase is StepPhase.STEPPING:
            raise FailedPrecondition(f"{what} during a step")
        self._layout.sync(self._state)

    def close(self) -> None:
        """Ends a step under way (abandoned, its weights left as they are: the stream may be
        closed already) and stops the threads."""
        try:
            self.abandon(put_in_model=False)
        finally:
            if self._release is not None:
                self._release.close()
                self._release = None
            self.intake.close()

    def drop_gradients(self, set_to_none: bool) -> None:
        """zero_grad() between a backward that gave gradients (overlap_backward) and step():
        torch drops them, so that step() applies none. The gradients taken so far are dropped,
        and buckets stepped during backward are taken back when their step is speculative (the
        state as it was). A step that cannot be taken back is refused, nothing changed: step()
        then applies it (after a backward that raised, with the gradients it gave, as torch's
        step() would)."""
        if self.phase is StepPhase.IDLE:
            return
        what = "OffloadedAdamW: zero_grad() between backward and step()"
        if not set_to_none:
            raise FailedPrecondition(
                f"{what} with set_to_none=False: with overlap_backward the gradients have left "
                "the parameters, so they cannot be zeroed and stepped as torch would; use "
                "set_to_none=True (torch's default), or call step() first")
        if self._comm is not None:
            raise FailedPrecondition(f"{what}: the gradients taken are being summed over the "
                                     "ranks already; call step() first")
        if self.phase is StepPhase.STEPPING and not self._verdict.speculate:
            raise FailedPrecondition(
                f"{what}: {len(self._stepped())} bucket(s) were stepped during backward "
                "(overlap_backward), which cannot be taken back unless the step is speculative "
                "(max_grad_norm or skip_nonfinite); call step() to apply the step")
        if self.phase is StepPhase.STEPPING:
            self.abandon()
        else:
            self._end_step()

    # ---- gradients during backward (the intake's events) ----

    def _prepare(self) -> None:
        """At a step's first gradient: the groups as they are now, the buckets' expectations."""
        if self.phase is not StepPhase.IDLE:
            return
        self._layout.sync(self._state)
        self.phase = StepPhase.GRADIENTS
        self.intake.expect()

    def _admit(self, b: Bucket) -> None:
        """Before a streamed bucket's gradients are first held this step: where they page (an
        NVMe unit's), backward waits while buckets wait for their launch (_release). Only
        buckets launched during backward wait there (_hand_over), so a step that launches at
        step() never waits; a host unit's gradients stay held to the step's end anyway."""
        if self._launcher is not None and b.buffers.pages:
            self._launcher.wait_room()

    def _hand_over(self, b: Bucket) -> None:
        """Steps the complete bucket b (sharded: issues the reduces in order, and steps this
        rank's buckets whose sums are in). On the hand-over thread, in completion order."""
        if self._comm is None:
            b.grads_aside()  # (an NVMe unit's) its gradients wait for their launch unheld
            if self._verdict.steps_early():
                self._launcher.add(b)
            return
        self._comm.reduce_ready(self._layout.active())
        if not self._verdict.steps_early():
            return
        for owned in self._comm.reduced(self._layout.owned, wait=False):
            if owned.flag():  # this rank's buckets whose gradients are summed by now
                self._launch(owned)
                self._early += 1

    def _launch_early(self, b: Bucket) -> None:
        if b.flag():
            self._launch(b)
            self._early += 1

    # ---- the step ----

    def step(self, grad_scale: float) -> None:
        """Applies the step (optimizer.step() without its closure)."""
        start = time.perf_counter()
        try:
            self.settle()
            error = self._launcher.clear() if self._launcher else None  # the rest: below
            if error is not None:
                raise error
            self._drain()
        except BaseException:
            self.abandon()
            raise
        self._refuse_late_changes(grad_scale)
        if self.phase is not StepPhase.STEPPING:
            self._layout.sync(self._state)
            self.phase = StepPhase.GRADIENTS
        todo = self.intake.take_rest(self._comm)
        verdict = self._verdict
        inv = verdict.inverse(grad_scale)
        rolled_back, norm = False, None
        if verdict.checks and verdict.speculate:
            # One norm on every rank (a collective when sharded), of the gradients unscaled and
            # before anything changes them: it decides for every rank alike.
            norm = verdict.grad_norm(self._groups(), self._stepped() + todo,
                                     None if grad_scale == 1.0 else inv)
            self.last_grad_norm = float(norm)
            if self.phase is StepPhase.STEPPING and not verdict.speculation_holds(norm,
                                                                                 grad_scale):
                # Discard the buckets stepped during backward and step them all again, exactly.
                # (When the speculation holds, the rest are stepped as those were.)
                self._state.give_up(speculative=True)
                self.phase = StepPhase.GRADIENTS
                self._early = 0
                todo = self._stepped() + todo
                for b in todo:
                    b.this_step.launched = False
                self.rolled_back_steps += 1
                rolled_back = True
        verdict.spec_scale = grad_scale
        if self.phase is not StepPhase.STEPPING:  # nothing stepped yet: unscale, skip or clip
            norm = verdict.apply(self._groups(), todo, grad_scale, norm)
            if norm is not None:
                self.last_grad_norm = float(norm)
                if verdict.skips(norm):
                    self.skipped_steps += 1
                    self._end_step()
                    self.last_stats = {"skipped": 1.0, "rolled_back": float(rolled_back),
                                       "dist_bytes": self._dist_bytes(),
                                       "tail_s": time.perf_counter() - start}
                    return
            self._begin(1.0)
        for b in todo:
            self._launch(b)
        self._finish(start, rolled_back)

    def _refuse_late_changes(self, grad_scale: float) -> None:
        """Refuses (abandoning what backward stepped) what step() cannot honour exactly."""
        if not grad_scale > 0 or math.isinf(grad_scale):
            raise InvalidArgument(f"grad_scale must be finite and > 0, not {grad_scale}")
        if grad_scale != 1.0 and self._overlap() and not self._verdict.speculate:
            self.abandon()
            raise FailedPrecondition("OffloadedAdamW: buckets were stepped during backward, "
                                     "unscaled; loss scaling with overlap_backward needs "
                                     "skip_nonfinite=True")
        if self.phase is not StepPhase.STEPPING:
            return
        if self._layout.changed():
            self.abandon()
            raise FailedPrecondition("OffloadedAdamW: the parameter groups changed between "
                                     "backward and step(), while buckets were being stepped "
                                     "during backward: change them between step() and the next "
                                     "backward")
        if any(b.written_since_flagged() for b in self._stepped()):
            self.abandon(put_in_model=False)  # the caller's weights stand
            raise FailedPrecondition("OffloadedAdamW: weights changed between backward and step(), "
                                     "after they were stepped during backward (overlap_backward): "
                                     "change them between step() and the next backward")

    def _stepped(self) -> List[Bucket]:
        """The buckets given to the optimizer this step."""
        mine = self._layout.active() if self._comm is None else self._layout.owned
        return [b for b in mine if b.this_step.launched]

    def _begin(self, grad_scale: float) -> None:
        if self._pending_copy is not None:  # last step's weights copied out of `out` buffers
            self._pending_copy.synchronize()
            self._pending_copy = None
        self._state.begin(self._layout.owned, grad_scale)
        self.phase = StepPhase.STEPPING

    def _launch(self, b: Bucket) -> None:
        if self.phase is not StepPhase.STEPPING:  # in backward: at the last step's loss scale
            self._begin(self._verdict.spec_scale if self._verdict.speculate else 1.0)
        if b.this_step.event is not None:
            b.this_step.event.synchronize()
        if self._release is not None:
            self._release.room_to_launch(b)
        b.buffers.hold_next()
        b.prime_out()
        self._state.launch(b)
        b.this_step.launched = True
        if self._release is not None:  # unless the step may be taken again, its grads go
            self._release.launched(b, free_grads=not self._verdict.speculate)

    def _finish(self, start: float, rolled_back: bool) -> None:
        """Waits for the library's step, then puts the new weights into the model."""
        early = self._early
        reduces_early = self._comm.early if self._comm is not None else 0
        try:
            stats = self._state.finish(self._layout.owned)
        except BaseException:
            self._end_step()
            raise
        self._put_in_model()
        stats.update({"buckets": float(len([b for b in self._layout.owned if b.active])),
                      "buckets_during_backward": float(early),
                      "reduces_during_backward": float(reduces_early),
                      "rolled_back": float(rolled_back), "dist_bytes": self._dist_bytes(),
                      "tail_s": time.perf_counter() - start})
        self.last_stats = stats

    def _put_in_model(self) -> None:
        """The step's end: the new weights of the buckets stepped go into the model (a
        streamed range's next version made current), and the step's holds go."""
        self._drain()
        written = self._stepped()
        self._end_step(unbind=False)
        try:
            self._pending_copy = write_back(written, self._layout.active(), self._comm)
        finally:
            for b in self._layout.buckets:
                b.unbind()

    def _dist_bytes(self) -> float:
        return float(self._comm.take_moved()) if self._comm is not None else 0.0

    def _drain(self) -> None:
        if self._release is not None:
            self._release.drain()

    def _end_step(self, unbind: bool = True) -> None:
        if self._launcher is not None:
            self._launcher.clear()
        self._drain()
        self.phase = StepPhase.IDLE
        self._early = 0
        if self._comm is not None:
            self._comm.end_step()
        for b in self._layout.buckets:
            if unbind:
                b.unbind()
            b.reset_step()
        self.intake.end_step()
        self.install_hooks()  # parameters that now require a gradient

    def abandon(self, put_in_model: bool = True) -> None:
        """Ends a step begun during backward without applying more (after an error): abandoned
        when speculative, else finished with what it applied, the weights with the state (with
        `put_in_model`). Sharded, where every rank broadcasts the new weights alike and this one
        may be alone in ending the step, the weights are left as they were."""
        try:
            self.settle()
        except BaseException:  # noqa: B036 (the step is being given up already)
            pass
        if self.phase is not StepPhase.STEPPING:
            return
        speculative = self._verdict.speculate
        try:
            self._state.give_up(speculative)
        except BaseException:
            self._end_step()
            raise
        if speculative or self._comm is not None or not put_in_model:
            self._end_step()
        else:
            self._put_in_model()
