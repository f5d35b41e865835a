"""OffloadedAdamW: torch.optim.AdamW with its fp32 master weights and moments in the node's tierd.

The optimizer's face, over rooms that each own one concern: _layout.py (the parameter groups as
buckets), _state.py (the state in the client library's optimizer, and torch's state_dict),
_stepping.py (when each part of a step happens, from the first gradient to the new weights),
_verdict.py (unscale, skip, clip, and whether speculation holds), _shard.py (the collectives over
ranks), _lanes.py (which buckets the device steps), _state_files.py (files).
"""
import logging
import time
from typing import Any, Dict, Optional, Union

import torch

from .._errors import InvalidArgument
from ..client import TierdError
from . import _state_files, _lanes
from ._layout import BucketLayout
from ._shard import Comm
from ._state import OptimizerState, open_on_every_rank
from ._stepping import StepPhase, Stepper
from ._verdict import Verdict

_DEFAULT_BUCKET_PARAMS = 4 << 20

log = logging.getLogger(__name__)


def _check_arguments(lr, betas, eps, weight_decay, amsgrad, maximize, capturable,
                     differentiable, max_grad_norm, accumulation_steps, bucket_params, home,
                     state_dtype, name, resume, reset, host_budget_bytes) -> None:
    if any(isinstance(v, torch.Tensor) for v in (lr, *betas[:2])):
        raise InvalidArgument("OffloadedAdamW takes lr and betas as floats, not Tensors (its "
                              "kernels read them as numbers, not from a device)")
    # Then torch.optim.AdamW's checks, in its order and words.
    if not 0.0 <= lr:
        raise InvalidArgument(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise InvalidArgument(f"Invalid epsilon value: {eps}")
    for k in (0, 1):
        if not 0.0 <= betas[k] < 1.0:
            raise InvalidArgument(f"Invalid beta parameter at index {k}: {betas[k]}")
    if not 0.0 <= weight_decay:
        raise InvalidArgument(f"Invalid weight_decay value: {weight_decay}")
    if not all(isinstance(b, float) for b in betas[:2]):
        raise InvalidArgument("betas must be either both floats or both Tensors")
    if amsgrad:
        raise InvalidArgument("OffloadedAdamW does not implement amsgrad (its fused kernels keep "
                              "exp_avg and exp_avg_sq only): use torch.optim.AdamW for amsgrad")
    if maximize or capturable or differentiable:
        raise InvalidArgument("OffloadedAdamW does not support maximize, capturable or "
                              "differentiable")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise InvalidArgument(f"max_grad_norm must be > 0, not {max_grad_norm}")
    if accumulation_steps < 1 or bucket_params < 1:
        raise InvalidArgument("accumulation_steps and bucket_params must be >= 1")
    if home not in (None, "host", "nvme"):
        raise InvalidArgument(f"home must be 'host', 'nvme' or None, not {home!r}")
    if host_budget_bytes != "auto" and (isinstance(host_budget_bytes, bool) or not isinstance(
            host_budget_bytes, int) or host_budget_bytes < 0):
        raise InvalidArgument(f"host_budget_bytes must be 'auto' or an int >= 0, not "
                              f"{host_budget_bytes!r}")
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise InvalidArgument(f"state_dtype must be torch.float32 or torch.bfloat16, not "
                              f"{state_dtype}")
    if name is None and (resume or reset):
        raise InvalidArgument("resume and reset need a name")


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
        host_budget_bytes or the room the host tier has for it ("auto"'s share, and what is free)
        and the daemon has NVMe, else host.
    host_budget_bytes: host-tier bytes the state streams through (scratch state at home on
        NVMe keeps what the budget holds beyond a window on the host between steps). "auto": the
        daemon's host tier split among the job's ranks on the node (LOCAL_WORLD_SIZE); where
        the parameters are streamed, half of that, less where their weights need more room to
        stay in the tier (what is left beyond them and an eighth of the share, an eighth at the
        least); else for scratch state what of it is free when the optimizer is made, for
        persistent state all of it. The bytes chosen are in `host_budget_bytes` once made. A
        number beyond the rank's share of the tier, for state at home on NVMe, warns.
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
        emulated device; see docs/optimizer/pytorch.md). Needs the daemon's device tier and
        fp32 moments.
    device_budget_bytes: device-tier bytes of the device share's state kept there from one step
        to the next rather than sent home and brought up again each step (the buckets stepped
        last, as far as they fit; twice their state when clipping or skipping steps
        speculatively). Reading the state (state_dict) brings it home. Scratch state only.
    process_group: data-parallel ranks to shard the state over, ZeRO-1 style: each rank keeps
        and steps its share of the buckets, gradients are averaged over the ranks (as DDP does;
        the model need not be wrapped in DDP) and the new weights are broadcast. None: torch's
        default group when torch.distributed is initialised with more than one rank (torchrun),
        else no sharding. With a name, rank r of n keeps its share as "<name>.rank<r>of<n>":
        resume with as many ranks. state_dict() then holds this rank's parameters only.

    As torch.optim.AdamW: a parameter without a gradient in a step (frozen, or unused) is left
    exactly as it is, with its moments and its own step count; parameter groups may be added
    (add_param_group) and their params lists edited between steps; weights changed between steps
    (a clamp, a load, an average swapped in) are stepped from as they are. See
    docs/optimizer/pytorch.md.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 name: Optional[str] = None, resume: Optional[bool] = None,
                 reset: bool = False, home: Optional[str] = None,
                 host_budget_bytes: Union[int, str] = "auto",
                 state_dtype: torch.dtype = torch.float32, max_grad_norm: Optional[float] = None,
                 skip_nonfinite: bool = False, overlap_backward: bool = False,
                 accumulation_steps: int = 1, bucket_params: int = _DEFAULT_BUCKET_PARAMS,
                 socket_dir: Optional[str] = None, threads: int = 0, process_group=None,
                 device_share: _lanes.Setting = None, device_budget_bytes: int = 0):
        _lanes.check(device_share)
        _lanes.check_budget(device_budget_bytes, name)
        _check_arguments(lr, betas, eps, weight_decay, amsgrad, maximize, capturable,
                         differentiable, max_grad_norm, accumulation_steps, bucket_params, home,
                         state_dtype, name, resume, reset, host_budget_bytes)
        self.state_dtype = state_dtype
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, foreach=foreach, capturable=False,
                        differentiable=False, fused=fused)
        self._state: Optional[OptimizerState] = None  # before anything that can fail: close()
        self._stepper: Optional[Stepper] = None
        super().__init__(params, defaults)
        self.overlap_backward = overlap_backward
        self.bucket_params = bucket_params
        self.socket_dir = socket_dir  # the daemon's (None: $TIERD_SOCKET_DIR, else /run/tierd)
        self._comm = Comm.create(process_group)
        self._verdict = Verdict(max_grad_norm, skip_nonfinite, overlap_backward and (
            max_grad_norm is not None or skip_nonfinite), self._comm)
        self._layout = BucketLayout(lambda: self.param_groups, bucket_params, self._comm)
        self._state = open_on_every_rank(
            self._layout.owned, self._comm, name=name, scratch_id=id(self), socket_dir=socket_dir,
            home=home, host_budget_bytes=host_budget_bytes, threads=threads, resume=resume,
            reset=reset, state_dtype=state_dtype, speculative=self._verdict.speculate,
            masters_in_out=self._comm is None and device_share is None, defaults=self.defaults,
            device_budget_bytes=device_budget_bytes, streamed_bytes=self._layout.streamed_bytes())
        self._state.lanes = _lanes.DeviceLanes(device_share, device_grads=self._comm is None)
        self._state.lanes.place(self._state.adam, self._layout.owned)  # refused here
        if self._comm is not None:
            self._comm.share_params(self._layout.buckets)
            self._comm.share_frozen(self._layout.frozen())
        for b in self._layout.buckets:
            b.mirror()
        self._stepper = Stepper(lambda: self.param_groups, lambda: self.overlap_backward,
                                self._layout, self._state, self._verdict, self._comm,
                                accumulation_steps)
        log.info("%s%s", repr(self), f", rank {self._comm.rank} of {self._comm.world}'s share"
                 if self._comm else "")

    # ---- what the user reads and sets ----

    max_grad_norm = property(lambda self: self._verdict.max_grad_norm,
                             lambda self, v: setattr(self._verdict, "max_grad_norm", v))
    skip_nonfinite = property(lambda self: self._verdict.skip_nonfinite,
                              lambda self, v: setattr(self._verdict, "skip_nonfinite", v))
    # The parameters in the order clip_grad_norm_ is given them (None: the groups' order).
    grad_norm_order = property(lambda self: self._verdict.order,
                               lambda self, v: setattr(self._verdict, "order", v and list(v)))
    home = property(lambda self: self._state.home)
    host_budget_bytes = property(lambda self: self._state.host_budget_bytes)  # "auto" resolved
    # The step's figures and phase (_stepping.Stepper's).
    phase = property(lambda self: self._stepper.phase if self._stepper else StepPhase.IDLE)
    last_grad_norm = property(lambda self: self._stepper.last_grad_norm)
    last_stats = property(lambda self: self._stepper.last_stats)
    skipped_steps = property(lambda self: self._stepper.skipped_steps)
    rolled_back_steps = property(lambda self: self._stepper.rolled_back_steps)

    @property
    def accumulation_steps(self) -> int:
        """Backward passes per step (overlap_backward): a bucket is stepped once each of its
        parameters has had this many gradients. Set between steps."""
        return self._stepper.intake.accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"accumulation_steps must be an int >= 1, not {value!r}")
        self._between_steps("setting accumulation_steps")
        self._stepper.intake.accumulation_steps = value

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
        self._state.lanes.change(value, self._state.adam, self._layout.owned,
                                 self._state.device_tier)

    # ---- the parameter groups, as they are now ----

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's add_param_group; the group's state is made (or, for persistent state that
        recorded it, resumed, setting its weights) at once."""
        super().add_param_group(param_group)
        if getattr(self, "_stepper", None) is None or self.phase is StepPhase.STEPPING:
            return  # torch's __init__ adding the first groups; or refused at step()
        try:
            self._layout.sync(self._state)
        except (TypeError, ValueError):
            self.param_groups.pop()  # refused: as if never added
            raise
        self._stepper.install_hooks()

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """torch's zero_grad; params lists edited since the last step are taken in first (their
        state made, or resumed, before the forward pass that uses them). Between a backward that
        gave gradients (overlap_backward) and step(), the step's gradients are dropped, as
        torch's are (Stepper.drop_gradients)."""
        self._stepper.settle()
        self._stepper.drop_gradients(set_to_none is not False)
        if self.phase is not StepPhase.STEPPING:
            self._layout.sync(self._state)
            self._stepper.install_hooks()
        if set_to_none is None:
            super().zero_grad()
        else:
            super().zero_grad(set_to_none=set_to_none)

    # ---- the step ----

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        """Applies the step. `grad_scale`: the gradients are multiplied by it (fp16 loss scaling);
        they are unscaled, then clipped, as GradScaler.unscale_ and clip_grad_norm_ would."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stepper.step(grad_scale)
        return loss

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
        self._stepper.between_steps(what)

    def save_checkpoint(self, directory: str, format: Optional[str] = None) -> None:
        """Writes every rank's share of the state (its state_dict) to `directory`; call it on
        every rank. When it returns on any rank, every rank's share is written. load_checkpoint
        reads it into a job of any number of ranks, on any nodes.

        `format`: "dcp", a torch.distributed.checkpoint checkpoint (torch 2.2 and newer), or
        "torch", a torch.save file per rank (any torch); by default dcp where torch has it."""
        rank, world = (self._comm.rank, self._comm.world) if self._comm else (0, 1)
        group = self._comm.group if self._comm else None
        start = time.monotonic()
        _state_files.save(directory, rank, world, self.state_name, self.state_dict(), format,
                         group)
        if self._comm is not None:
            self._comm.barrier()
        log.info("OffloadedAdamW: state saved to %s in %.2f s", directory, time.monotonic() - start)

    def load_checkpoint(self, directory: str) -> None:
        """Loads a checkpoint that save_checkpoint wrote, in either format, whatever number of
        ranks saved it: each rank reads the state of the parameters it owns now (the state
        resharded). Call it on every rank, after loading the model's weights, on an optimizer
        made afresh (reset=True) under the job's name."""
        group = self._comm.group if self._comm else None
        start = time.monotonic()
        self.load_state_dict(_state_files.load(directory, self._layout.owned_shapes(), group))
        log.info("OffloadedAdamW: state loaded from %s in %.2f s", directory,
                 time.monotonic() - start)

    # ---- lifetime ----

    def close(self) -> None:
        """Ends the optimizer's session (scratch state is freed; persistent state stays)."""
        if getattr(self, "_state", None) is None:
            return
        if self._stepper is not None:  # kept: its figures stay readable
            try:
                self._stepper.close()
            except TierdError:
                pass
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
