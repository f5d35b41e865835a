"""OffloadedAdamW: torch.optim.AdamW with its fp32 master weights and moments in the node's tierd.

The orchestration of a step, over rooms that each own one concern: _layout.py (the parameter
groups as buckets), _state.py (the state in the client library's optimizer, and torch's
state_dict), _intake.py (gradients taken during backward), _verdict.py (unscale, skip, clip, and
whether speculation holds), _shard.py (the collectives over ranks), _state_files.py (files). This
file decides when each happens; the kernels and the state's I/O run in the client library, which
carries out what is decided here (steps, abandons) and decides nothing of a step itself.
"""
import enum
import math
import time
from typing import Any, Dict, List, Optional

import torch

from .. import _abi
from ..client import TierdError
from . import _state_files, _lanes
from ._buckets import Bucket, write_back
from ._intake import GradientIntake
from ._layout import BucketLayout
from ._release import EarlyRelease, Launcher
from ._shard import Comm
from ._state import OptimizerState, open_on_every_rank
from ._verdict import Verdict

_DEFAULT_BUCKET_PARAMS = 4 << 20


class StepPhase(enum.Enum):
    IDLE = enum.auto()       # between steps: the groups may change
    GRADIENTS = enum.auto()  # the step's gradients are arriving: its buckets are fixed
    STEPPING = enum.auto()   # the library's step is begun: buckets are being stepped


def _check_arguments(lr, betas, eps, weight_decay, amsgrad, maximize, capturable,
                     differentiable, max_grad_norm, accumulation_steps, bucket_params, home,
                     state_dtype, name, resume, reset) -> None:
    if amsgrad:
        raise ValueError("OffloadedAdamW does not implement amsgrad (its fused kernels keep "
                         "exp_avg and exp_avg_sq only): use torch.optim.AdamW for amsgrad")
    if maximize or capturable or differentiable:
        raise ValueError("OffloadedAdamW does not support maximize, capturable or "
                         "differentiable")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 < eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"Invalid betas: {betas}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, not {max_grad_norm}")
    if accumulation_steps < 1 or bucket_params < 1:
        raise ValueError("accumulation_steps and bucket_params must be >= 1")
    if home not in (None, "host", "nvme"):
        raise ValueError(f"home must be 'host', 'nvme' or None, not {home!r}")
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, not "
                         f"{state_dtype}")
    if name is None and (resume or reset):
        raise ValueError("resume and reset need a name")


class OffloadedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with its state in tierd. Arguments as AdamW's (amsgrad, maximize and
    capturable are refused), and:

    name: persistent state under this name (resumed when it exists: the model's weights are then
        set from the optimizer's master weights); None: scratch state, freed on close(). At home
        in the host tier, the daemon writes it to NVMe when it stops cleanly; after a daemon
        crash it is lost, and resuming it fails with DATA_LOSS (reset=True starts afresh).
        Parameter groups added later (add_param_group) are recorded with it: a run that resumes
        adds them again as the first run did, and they resume then.
    resume: with a name, True opens existing state only (TierdError NOT_FOUND when there is
        none: a mistyped resume never starts afresh), False creates only (ALREADY_EXISTS when
        state of that name exists), None does either.
    reset: with a name, discards state of that name and starts afresh.
    home: "nvme" or "host" for the state's home tier; None: NVMe when the state is larger than
        host_budget_bytes and the daemon has NVMe, else host.
    host_budget_bytes: host-tier bytes the state streams through (scratch state at home on
        NVMe keeps what the budget holds beyond a window on the host between steps).
    state_dtype: torch.float32, or torch.bfloat16 for exp_avg and exp_avg_sq kept in bf16 (8 bytes
        of state per parameter instead of 12: a third less to store and move each step). The
        kernels round them stochastically, so they stay right on average where rounding to
        nearest would stall; the master weights stay fp32, and state_dict() exports the moments
        as fp32. Persistent state is resumed with the dtype it was created with.
    max_grad_norm: clip gradients to this global L2 norm (exactly as
        torch.nn.utils.clip_grad_norm_); the norm is in `last_grad_norm`.
    skip_nonfinite: a step whose gradients hold an inf or NaN changes nothing (for fp16 loss
        scaling); counted in `skipped_steps`.
    overlap_backward: take gradients as backward produces them (see the module's text).
    accumulation_steps: backward passes per step when overlap_backward is on.
    bucket_params: parameters per bucket (the unit stepped during backward).
    socket_dir: the daemon's socket directory ($TIERD_SOCKET_DIR, else /run/tierd).
    threads: kernel threads (0: one per CPU this process may use).
    device_share: None (every bucket stepped by the CPU), a number in [0, 1] or "auto": that
        share of the parameters (in whole buckets, those whose gradients come last in backward)
        is stepped by the device's kernels, their state brought up into the daemon's device tier
        each step and sent home again, while the CPU steps the rest; "auto" balances the two
        lanes from their measured rates. The same results as the CPU's (bit for bit on an
        emulated device; see docs/optimizer.md). Needs the daemon's device tier and fp32 moments.
    process_group: data-parallel ranks to shard the state over, ZeRO-1 style: each rank keeps
        and steps its share of the buckets, gradients are averaged over the ranks (as DDP does;
        the model need not be wrapped in DDP) and the new weights are broadcast. None: torch's
        default group when torch.distributed is initialised with more than one rank (torchrun),
        else no sharding. With a name, rank r of n keeps its share as "<name>.rank<r>of<n>":
        resume with as many ranks. state_dict() then holds this rank's parameters only.

    As torch.optim.AdamW: a parameter without a gradient in a step (frozen, or unused) is left
    exactly as it is, with its moments and its own step count; parameter groups may be added
    (add_param_group) and their params lists edited between steps; weights changed between steps
    (a clamp, a load, an average swapped in) are stepped from as they are. See docs/optimizer.md.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 name: Optional[str] = None, resume: Optional[bool] = None,
                 reset: bool = False, home: Optional[str] = None,
                 host_budget_bytes: int = 1 << 30, state_dtype: torch.dtype = torch.float32,
                 max_grad_norm: Optional[float] = None,
                 skip_nonfinite: bool = False, overlap_backward: bool = False,
                 accumulation_steps: int = 1, bucket_params: int = _DEFAULT_BUCKET_PARAMS,
                 socket_dir: Optional[str] = None, threads: int = 0, process_group=None,
                 device_share: _lanes.Setting = None):
        _lanes.check(device_share)
        _check_arguments(lr, betas, eps, weight_decay, amsgrad, maximize, capturable,
                         differentiable, max_grad_norm, accumulation_steps, bucket_params, home,
                         state_dtype, name, resume, reset)
        self.state_dtype = state_dtype
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, foreach=foreach, capturable=False,
                        differentiable=False, fused=fused)
        self._state: Optional[OptimizerState] = None  # before anything that can fail: close()
        self._intake: Optional[GradientIntake] = None
        self._release: Optional[EarlyRelease] = None
        super().__init__(params, defaults)
        self.overlap_backward = overlap_backward
        self.bucket_params = bucket_params
        self.last_grad_norm: Optional[float] = None
        self.last_stats: Dict[str, float] = {}
        self.skipped_steps = 0
        self.rolled_back_steps = 0
        self.phase = StepPhase.IDLE
        self._pending_copy = None  # the last step's copies into GPU weights
        self._early = 0  # buckets given to the optimizer during this step's backward
        self._comm = Comm.create(process_group)
        self._verdict = Verdict(max_grad_norm, skip_nonfinite, overlap_backward and (
            max_grad_norm is not None or skip_nonfinite), self._comm)
        self._layout = BucketLayout(lambda: self.param_groups, bucket_params, self._comm)
        self._state = open_on_every_rank(
            self._layout.owned, self._comm, name=name, scratch_id=id(self), socket_dir=socket_dir,
            home=home, host_budget_bytes=host_budget_bytes, threads=threads, resume=resume,
            reset=reset, state_dtype=state_dtype, speculative=self._verdict.speculate,
            masters_in_out=self._comm is None and device_share is None, defaults=self.defaults)
        self._state.lanes = _lanes.DeviceLanes(device_share)
        self._state.lanes.place(self._state.adam, self._layout.owned)  # refused here
        if self._comm is not None:
            self._comm.share_params(self._layout.buckets)
            self._comm.share_frozen(self._layout.frozen())
        for b in self._layout.buckets:
            b.mirror()
        self._intake = GradientIntake(self._layout, accumulation_steps, self._comm is not None,
                                      self._prepare, self._hand_over)
        self._launcher: Optional[Launcher] = None
        if self._comm is None:  # sharded, a rank's buckets are broadcast from `out` at the end
            self._release = EarlyRelease(self._state.wait, lambda: self._launcher.room_made())
            self._launcher = Launcher(self._release, self._launch_early, self._intake.submit)
        self._install_hooks()

    # ---- what the user reads and sets ----

    max_grad_norm = property(lambda self: self._verdict.max_grad_norm,
                             lambda self, v: setattr(self._verdict, "max_grad_norm", v))
    skip_nonfinite = property(lambda self: self._verdict.skip_nonfinite,
                              lambda self, v: setattr(self._verdict, "skip_nonfinite", v))
    home = property(lambda self: self._state.home)

    @property
    def accumulation_steps(self) -> int:
        """Backward passes per step (overlap_backward): a bucket is stepped once each of its
        parameters has had this many gradients. Set between steps."""
        return self._intake.accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, not {value!r}")
        self._between_steps("setting accumulation_steps")
        self._intake.accumulation_steps = value

    persistent = property(lambda self: self._state.persistent)
    state_name = property(lambda self: self._state.name)
    resumed = property(lambda self: self._state.resumed)
    steps_taken = property(lambda self: self._state.adam.steps_taken)
    state_bytes = property(lambda self: self._state.adam.state_bytes)

    @property
    def device_share(self) -> _lanes.Setting:
        """The share of the parameters stepped on the device (see the class's text). Set between
        steps: placed at once (and refused at once where it cannot be), None puts every bucket
        back on the CPU."""
        return self._state.lanes.setting

    @device_share.setter
    def device_share(self, value: _lanes.Setting) -> None:
        _lanes.check(value)
        self._between_steps("setting device_share")
        if value is not None and not self._state.device_tier:
            raise TierdError(_abi.Status.FAILED_PRECONDITION,
                             "device_share needs the daemon's device tier, and this daemon "
                             "serves none")
        lanes, before = self._state.lanes, self._state.lanes.setting
        lanes.setting = value
        try:
            lanes.place(self._state.adam, self._layout.owned)
        except BaseException:
            lanes.setting = before
            lanes.place(self._state.adam, self._layout.owned)
            raise

    # ---- the parameter groups, as they are now ----

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's add_param_group; the group's state is made (or, for persistent state that
        recorded it, resumed, setting its weights) at once."""
        super().add_param_group(param_group)
        if getattr(self, "_state", None) is None or self.phase is StepPhase.STEPPING:
            return  # torch's __init__ adding the first groups; or refused at step()
        try:
            self._layout.sync(self._state)
        except (TypeError, ValueError):
            self.param_groups.pop()  # refused: as if never added
            raise
        self._install_hooks()

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """torch's zero_grad; params lists edited since the last step are taken in first (their
        state made, or resumed, before the forward pass that uses them)."""
        self._settle()
        if self.phase is not StepPhase.STEPPING:
            self._layout.sync(self._state)
            self._install_hooks()
        if set_to_none is None:
            super().zero_grad()
        else:
            super().zero_grad(set_to_none=set_to_none)

    # ---- gradients during backward (the intake's events) ----

    def _prepare(self) -> None:
        """At a step's first gradient: the groups as they are now, the buckets' expectations."""
        if self.phase is not StepPhase.IDLE:
            return
        self._layout.sync(self._state)
        self.phase = StepPhase.GRADIENTS
        self._intake.expect()

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

    def _install_hooks(self) -> None:
        if self.overlap_backward:  # every parameter that requires a gradient now
            self._intake.install(self.param_groups)

    def _settle(self) -> None:
        if self._intake is not None:
            self._intake.settle()

    # ---- the step ----

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        """Applies the step. `grad_scale`: the gradients are multiplied by it (fp16 loss scaling);
        they are unscaled, then clipped, as GradScaler.unscale_ and clip_grad_norm_ would."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        try:
            self._settle()
            error = self._launcher.clear() if self._launcher else None  # the rest: below
            if error is not None:
                raise error
            self._drain()
        except BaseException:
            self._abandon()
            raise
        self._refuse_late_changes(grad_scale)
        if self.phase is not StepPhase.STEPPING:
            self._layout.sync(self._state)
            self.phase = StepPhase.GRADIENTS
        todo = self._intake.take_rest(self._comm)
        verdict = self._verdict
        inv = verdict.inverse(grad_scale)
        rolled_back, norm = False, None
        if verdict.checks and verdict.speculate:
            # One norm on every rank (a collective when sharded), of the gradients unscaled and
            # before anything changes them: it decides for every rank alike.
            norm = verdict.grad_norm(self.param_groups, self._stepped() + todo,
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
                    b.launched = False
                self.rolled_back_steps += 1
                rolled_back = True
        verdict.spec_scale = grad_scale
        if self.phase is not StepPhase.STEPPING:  # nothing stepped yet: unscale, skip or clip
            norm = verdict.apply(self.param_groups, todo, grad_scale, norm)
            if norm is not None:
                self.last_grad_norm = float(norm)
                if verdict.skips(norm):
                    self.skipped_steps += 1
                    self._end_step()
                    self.last_stats = {"skipped": 1.0, "rolled_back": float(rolled_back),
                                       "dist_bytes": self._dist_bytes(),
                                       "tail_s": time.perf_counter() - start}
                    return loss
            self._begin(1.0)
        for b in todo:
            self._launch(b)
        self._finish(start, rolled_back)
        return loss

    def _refuse_late_changes(self, grad_scale: float) -> None:
        """Refuses (abandoning what backward stepped) what step() cannot honour exactly."""
        if not grad_scale > 0 or math.isinf(grad_scale):
            raise ValueError(f"grad_scale must be finite and > 0, not {grad_scale}")
        if grad_scale != 1.0 and self.overlap_backward and not self._verdict.speculate:
            self._abandon()
            raise RuntimeError("OffloadedAdamW: buckets were stepped during backward, unscaled; "
                               "loss scaling with overlap_backward needs skip_nonfinite=True")
        if self.phase is not StepPhase.STEPPING:
            return
        if self._layout.changed():
            self._abandon()
            raise RuntimeError("OffloadedAdamW: the parameter groups changed between backward "
                               "and step(), while buckets were being stepped during backward: "
                               "change them between step() and the next backward")
        if any(b.written_since_flagged() for b in self._stepped()):
            self._abandon()
            raise RuntimeError("OffloadedAdamW: weights changed between backward and step(), "
                               "after they were stepped during backward (overlap_backward): "
                               "change them between step() and the next backward")

    def _stepped(self) -> List[Bucket]:
        """The buckets given to the optimizer this step."""
        mine = self._layout.active() if self._comm is None else self._layout.owned
        return [b for b in mine if b.launched]

    def _begin(self, grad_scale: float) -> None:
        if self._pending_copy is not None:  # last step's weights copied out of `out` buffers
            self._pending_copy.synchronize()
            self._pending_copy = None
        self._state.begin(self._layout.owned, grad_scale)
        self.phase = StepPhase.STEPPING

    def _launch(self, b: Bucket) -> None:
        if self.phase is not StepPhase.STEPPING:  # in backward: at the last step's loss scale
            self._begin(self._verdict.spec_scale if self._verdict.speculate else 1.0)
        if b.event is not None:
            b.event.synchronize()
        if self._release is not None:
            self._release.room_to_launch(b)
        b.bind()
        b.prime_out()
        self._state.launch(b)
        b.launched = True
        if self._release is not None:  # unless the step may be taken again, its grads go
            self._release.launched(b, free_grads=not self._verdict.speculate)

    def _finish(self, start: float, rolled_back: bool) -> None:
        """Waits for the library's step, then puts the new weights into the model."""
        early = self._early
        reduces_early = self._comm.early if self._comm is not None else 0
        try:
            stats = self._state.finish()
        except BaseException:
            self._end_step()
            raise
        self._drain()
        written = self._stepped()
        self._end_step(unbind=False)
        try:
            self._pending_copy = write_back(written, self._layout.active(), self._comm)
        finally:
            for b in self._layout.buckets:
                b.unbind()
        stats.update({"buckets": float(len([b for b in self._layout.owned if b.active])),
                      "buckets_during_backward": float(early),
                      "reduces_during_backward": float(reduces_early),
                      "rolled_back": float(rolled_back), "dist_bytes": self._dist_bytes(),
                      "tail_s": time.perf_counter() - start})
        self.last_stats = stats

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
        self._intake.end_step()
        self._install_hooks()  # parameters that now require a gradient

    def _abandon(self) -> None:
        """Ends a step begun during backward without applying more (after an error): abandoned
        when speculative, else finished with what it applied."""
        try:
            self._settle()
        except BaseException:  # noqa: B036 (the step is being given up already)
            pass
        if self.phase is StepPhase.STEPPING:
            try:
                self._state.give_up(self._verdict.speculate)
            finally:
                self._end_step()

    # ---- state ----

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim.AdamW's format (exp_avg, exp_avg_sq and step per parameter stepped at
        least once, as fp32 CPU tensors), plus `master` (the fp32 master weights) for parameters
        kept in another dtype. Sharded over ranks, `state` holds this rank's parameters: the union
        of the ranks' `state` dicts is the whole (each rank's can be loaded back into the rank
        that owns it, or the union into every rank)."""
        self._between_steps("state_dict")
        return self._state.export(self.param_groups, self._layout.owned)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state_dict of this class or of torch.optim.AdamW (the model's weights must be
        loaded first: they become the master weights unless the state carries `master`), each
        parameter with its own step count. Sharded over ranks, each rank loads the parameters it
        owns."""
        self._between_steps("load_state_dict")
        self._state.load(state_dict, self.param_groups, self._layout.owned)
        for b in self._layout.buckets:
            b.mirror()

    def _between_steps(self, what: str) -> None:
        self._settle()
        if self.phase is StepPhase.STEPPING:
            raise RuntimeError(f"{what} during a step")
        self._layout.sync(self._state)

    def save_checkpoint(self, directory: str, format: Optional[str] = None) -> None:
        """Writes every rank's share of the state (its state_dict) to `directory`; call it on
        every rank. When it returns on any rank, every rank's share is written. load_checkpoint
        reads it into a job of any number of ranks, on any nodes.

        `format`: "dcp", a torch.distributed.checkpoint checkpoint (torch 2.2 and newer), or
        "torch", a torch.save file per rank (any torch); by default dcp where torch has it."""
        rank, world = (self._comm.rank, self._comm.world) if self._comm else (0, 1)
        group = self._comm.group if self._comm else None
        _state_files.save(directory, rank, world, self.state_name, self.state_dict(), format,
                         group)
        if self._comm is not None:
            self._comm.barrier()

    def load_checkpoint(self, directory: str) -> None:
        """Loads a checkpoint that save_checkpoint wrote, in either format, whatever number of
        ranks saved it: each rank reads the state of the parameters it owns now (the state
        resharded). Call it on every rank, after loading the model's weights, on an optimizer
        made afresh (reset=True) under the job's name."""
        group = self._comm.group if self._comm else None
        self.load_state_dict(_state_files.load(directory, self._layout.owned_shapes(), group))

    # ---- lifetime ----

    def close(self) -> None:
        """Ends the optimizer's session (scratch state is freed; persistent state stays)."""
        if getattr(self, "_state", None) is None:
            return
        try:
            self._abandon()
        except TierdError:
            pass
        if self._release is not None:
            self._release.close()
            self._release = None
        if self._intake is not None:
            self._intake.close()
            self._intake = None
        self._state.close()
        self._state = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        moments = "bf16 moments, " if self.state_dtype == torch.bfloat16 else ""
        return (f"OffloadedAdamW({len(self._layout.buckets)} buckets, {moments}{self.home} "
                f"home, {'persistent' if self.persistent else 'scratch'})")
