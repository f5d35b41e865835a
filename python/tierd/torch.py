"""tierd for PyTorch: an AdamW whose fp32 master weights and moments live in the node's tierd.

    import tierd.torch
    opt = tierd.torch.OffloadedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                     name="run-42", host_budget_bytes=2 << 30)
    for batch in data:
        loss = model(batch).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

OffloadedAdamW is a torch.optim.Optimizer with torch.optim.AdamW's constructor, parameter groups
and state_dict format (loadable into and from a plain AdamW). The model keeps its own weights
(fp32, bf16 or fp16, on the CPU or a GPU); the optimizer keeps fp32 master weights, exp_avg and
exp_avg_sq in daemon chunks at home on NVMe or in the host tier, streamed through a bounded host
budget by the client library's fused CPU kernels, and writes the new weights back into the model
after each step.

`overlap_backward=True` hands gradients to the optimizer as backward produces them (copied off the
GPU on a side stream) and steps each bucket of parameters while backward still runs. The gradients
are taken as they were when produced: change them (clip, unscale) only through the optimizer's own
`max_grad_norm`, `skip_nonfinite` and `step(grad_scale=...)`. With clipping or skipping, those
buckets are stepped speculatively (as if the step would neither clip nor skip, at the last step's
loss scale) into a second version of the state; `step()` then checks the global norm and keeps
the speculative result when it is exactly what the clipped or skipped step gives, or abandons it
and steps again from the first version (`rolled_back_steps`): the result is always torch's.

`offload_activations(...)` (tierd/activations.py) keeps the tensors autograd saves for backward in
tierd chunks too; `as_tensor` views an acquired chunk as a tensor without a copy.
"""
import ctypes
import math
import os
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.utils.dlpack

from . import _abi, _shard
from .activations import ActivationOffload, ActivationStats, offload_activations
from .client import Acquisition, Tier, TierdError, _check, _library, connect

__all__ = ["ActivationOffload", "ActivationStats", "OffloadedAdamW", "as_tensor",
           "offload_activations"]


def as_tensor(acquisition: Acquisition, i: int, dtype: torch.dtype = torch.uint8,
              shape: Optional[List[int]] = None, offset: int = 0) -> torch.Tensor:
    """A torch tensor viewing chunk i of an acquisition without a copy (DLPack): CPU memory for a
    host chunk, CUDA memory for a device chunk. The chunk cannot be released while the tensor (or
    any view of its storage) lives."""
    name = str(dtype).replace("torch.", "")  # torch.float32 -> "float32", as the views name them
    return torch.utils.dlpack.from_dlpack(acquisition.dlpack(i, name, shape, offset))

_DTYPES = {torch.float32: _abi.FLOAT32, torch.bfloat16: _abi.BFLOAT16, torch.float16: _abi.FLOAT16}
_DEFAULT_BUCKET_PARAMS = 4 << 20


def _hyper(group: Dict[str, Any]) -> _abi.AdamHyper:
    """A parameter group's (or the defaults') hyperparameters for the C ABI: AdamW's decay."""
    return _abi.AdamHyper(group["lr"], group["betas"][0], group["betas"][1], group["eps"],
                          group["weight_decay"], 1)


class _Bucket:
    """Parameters of one torch parameter group, of one dtype and device, stepped as one tierd
    group: a flat gradient buffer filled as backward produces them and a flat buffer the kernel
    writes the new weights into. Sharded over ranks, each buffer has one more element (see
    _shard.py) and the bucket is stepped by its owner, at `slot` in that rank's tierd state."""

    def __init__(self, index: int, group: int, params: List[torch.Tensor], pin: bool):
        self.index = index
        self.group = group
        self.name = f"g{group}.{index}"
        self.owner = 0
        self.slot: Optional[int] = index
        self.params = params
        self.offsets = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.grad_ext = torch.zeros(n + 1, dtype=self.dtype, pin_memory=pin)
        self.out_ext = torch.zeros(n + 1, dtype=self.dtype, pin_memory=pin)
        self.grad = self.grad_ext[:n]
        self.out = self.out_ext[:n]
        self.arrived = 0          # params whose final gradient of this step is in `grad`
        self.present = False      # some parameter had a gradient this step
        self.event = None         # the side stream's copies, when the model is on a GPU
        self.launched = False     # given to the optimizer this step

    def slices(self, flat: torch.Tensor):
        for p, off in zip(self.params, self.offsets):
            yield p, flat[off:off + p.numel()]


class OffloadedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with its state in tierd. Arguments as AdamW's (amsgrad, maximize and
    capturable are refused), and:

    name: persistent state under this name (resumed when it exists: the model's weights are then
        set from the optimizer's master weights); None: scratch state, freed on close(). At home
        in the host tier, the daemon writes it to NVMe when it stops cleanly; after a daemon
        crash it is lost, and resuming it fails with DATA_LOSS (reset=True starts afresh).
    resume: with a name, True opens existing state only (TierdError NOT_FOUND when there is
        none: a mistyped resume never starts afresh), False creates only (ALREADY_EXISTS when
        state of that name exists), None does either.
    reset: with a name, discards state of that name and starts afresh.
    home: "nvme" or "host" for the state's home tier; None: NVMe when the state is larger than
        host_budget_bytes and the daemon has NVMe, else host.
    host_budget_bytes: host-tier bytes the state streams through.
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
    process_group: data-parallel ranks to shard the state over, ZeRO-1 style: each rank keeps
        and steps its share of the buckets, gradients are averaged over the ranks (as DDP does;
        the model need not be wrapped in DDP) and the new weights are broadcast. None: torch's
        default group when torch.distributed is initialised with more than one rank (torchrun),
        else no sharding. With a name, rank r of n keeps its share as "<name>.rank<r>of<n>":
        resume with as many ranks. state_dict() then holds this rank's parameters only.
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
                 socket_dir: Optional[str] = None, threads: int = 0, process_group=None):
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
        self.state_dtype = state_dtype
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, foreach=foreach, capturable=False,
                        differentiable=False, fused=fused)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.overlap_backward = overlap_backward
        self.accumulation_steps = accumulation_steps
        self.last_grad_norm: Optional[float] = None
        self.last_stats: Dict[str, float] = {}
        self.skipped_steps = 0
        # Buckets stepped during backward, before the global norm is known, into a second version
        # of the state (kept, or abandoned at step()); the loss scale they assumed.
        self._speculate = overlap_backward and (max_grad_norm is not None or skip_nonfinite)
        self._spec_scale = 1.0
        self.rolled_back_steps = 0
        self._handle = ctypes.c_void_p()
        self._hooks = []
        self._begun = False
        self._pending_copy = None  # the last step's copies into GPU weights
        self._early = 0  # buckets given to the optimizer during this step's backward

        self._buckets = self._make_buckets(bucket_params)
        self._comm = _shard.Comm.create(process_group)
        if self._comm is not None:
            self._comm.assign(self._buckets)
        self._owned = [b for b in self._buckets if b.slot is not None]
        per_param = 8 if state_dtype == torch.bfloat16 else 12
        state_bytes = per_param * sum(b.numel for b in self._owned)
        has_nvme = None
        if home is None or name is not None:
            with connect(socket_dir, "optimizer-probe") as c:
                has_nvme = c.tier_usage(Tier.NVME).configured
        if home is None:  # speculating, the state has two versions
            held = state_bytes * (2 if self._speculate else 1)
            home = "nvme" if held > host_budget_bytes and has_nvme else "host"
        if name is not None and not has_nvme:
            warnings.warn(f"OffloadedAdamW: state {name!r} is persistent, but the daemon has no "
                          "NVMe tier: it lives in host memory only and is lost when the daemon "
                          "stops", RuntimeWarning, stacklevel=2)
        self.home = home
        if name is None and (resume or reset):
            raise ValueError("resume and reset need a name")
        self._open(name, socket_dir, home, host_budget_bytes, threads, resume, reset)
        if self._comm is not None:
            try:
                self._comm.agree("whether the state was resumed", int(self.resumed))
                self._comm.agree("the steps taken", self.steps_taken)
            except RuntimeError:
                self.close()
                raise
            self._comm.share_params(self._buckets)
        if overlap_backward:
            self._install_hooks()

    # ---- construction ----

    def _make_buckets(self, bucket_params: int) -> List[_Bucket]:
        buckets = []  # (torch group, params)
        # Backward produces the last parameters' gradients first: buckets in reverse order, so
        # that the optimizer's read-ahead expects them in the order they will come.
        for gi in reversed(range(len(self.param_groups))):
            current: List[torch.Tensor] = []
            size = 0
            for p in reversed(self.param_groups[gi]["params"]):
                if p.dtype not in _DTYPES:
                    raise TypeError(f"OffloadedAdamW: a parameter of dtype {p.dtype}; "
                                    "float32, bfloat16 and float16 are supported")
                if current and (p.dtype != current[0].dtype or p.device != current[0].device
                                or size + p.numel() > bucket_params):
                    buckets.append((gi, current))
                    current, size = [], 0
                current.append(p)
                size += p.numel()
            if current:
                buckets.append((gi, current))
        return [_Bucket(i, gi, params, pin=params[0].is_cuda)
                for i, (gi, params) in enumerate(buckets)]

    def _open(self, name, socket_dir, home, host_budget_bytes, threads, resume, reset):
        lib = _library()
        options = _abi.AdamOptions()
        lib.tierd_adam_options_init(ctypes.byref(options))
        if socket_dir:
            options.socket_dir = socket_dir.encode()
        self.persistent = name is not None
        name = name or f"scratch-{os.getpid()}-{id(self):x}"
        if self._comm is not None:
            name = f"{name}.rank{self._comm.rank}of{self._comm.world}"
        self.state_name = name
        options.name = name.encode()
        options.persistent = 1 if self.persistent else 0
        options.reset = 1 if reset else 0
        options.open_mode = {None: _abi.ADAM_CREATE_OR_OPEN, True: _abi.ADAM_OPEN,
                             False: _abi.ADAM_CREATE}[resume]
        options.home_tier = _abi.TIER_NVME if home == "nvme" else _abi.TIER_HOST
        options.check_finite = 0  # the whole step is checked here, before any group is stepped
        options.threads = threads
        options.host_budget_bytes = host_budget_bytes
        options.state_dtype = _DTYPES[self.state_dtype]
        options.speculative = 1 if self._speculate else 0
        options.hyper = _hyper(self.defaults)
        n = len(self._owned)
        names = (ctypes.c_char_p * n)(*[b.name.encode() for b in self._owned])
        sizes = (ctypes.c_uint64 * n)(*[b.numel for b in self._owned])
        _check(lib.tierd_adam_create(n, names, sizes, ctypes.byref(options),
                                     ctypes.byref(self._handle)))
        self.resumed = bool(lib.tierd_adam_resumed(self._handle))
        for b in self._owned:
            if not lib.tierd_adam_initialized(self._handle, b.slot):
                flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32)
                                  for p in b.params])
                _check(lib.tierd_adam_set_params(self._handle, b.slot,
                                                 ctypes.c_void_p(flat.data_ptr()), b.numel))
            elif self.resumed:
                master = self._read(b, _abi.ADAM_PARAMS)
                with torch.no_grad():
                    for p, values in b.slices(master):
                        p.copy_(values.view_as(p))

    @torch.enable_grad()
    def _install_hooks(self):
        for b in self._buckets:
            for i, p in enumerate(b.params):
                if not p.requires_grad:
                    continue
                if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        lambda param, b=b, i=i: self._on_grad(b, i)))
                else:  # torch 1.13: a hook on the parameter's gradient accumulator
                    acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    handle = acc.register_hook(lambda *_, b=b, i=i: self._on_grad(b, i))
                    self._hooks.append((acc, handle))
        self._counts = {id(p): 0 for b in self._buckets for p in b.params}

    # ---- gradients in ----

    def _on_grad(self, b: _Bucket, i: int):
        p = b.params[i]
        key = id(p)
        self._counts[key] += 1
        if self._counts[key] < self.accumulation_steps or b.launched:
            return
        self._copy_grad(b, i)
        b.arrived += 1
        complete = b.arrived == len(b.params)
        if complete:
            b.present = True
        if self._comm is None:
            if complete and self._steps_early():
                self._launch(b)
                self._early += 1
            return
        if complete:
            self._comm.reduce_ready(self._buckets)
        if self._steps_early():  # this rank's buckets whose gradients are summed by now
            for owned in self._comm.reduced(self._owned, wait=False):
                self._launch(owned)
                self._early += 1

    def _copy_grad(self, b: _Bucket, i: int):
        p, off = b.params[i], b.offsets[i]
        dst = b.grad[off:off + p.numel()]
        if p.grad is None:
            dst.zero_()
        elif p.grad.is_cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(stream):
                dst.copy_(p.grad.detach().reshape(-1), non_blocking=True)
                p.grad.record_stream(stream)
                b.event = torch.cuda.Event()
                b.event.record(stream)
        else:
            dst.copy_(p.grad.detach().reshape(-1))

    def _side_stream(self):
        if getattr(self, "_stream", None) is None:
            self._stream = torch.cuda.Stream(self._buckets[0].device)
        return self._stream

    def _steps_early(self) -> bool:
        return self._speculate or (self.max_grad_norm is None and not self.skip_nonfinite)

    def _begin(self, grad_scale: float):
        lib = _library()
        if self._pending_copy is not None:  # last step's weights copied out of `out` buffers
            self._pending_copy.synchronize()
            self._pending_copy = None
        for b in self._owned:
            hyper = _hyper(self.param_groups[b.group])
            _check(lib.tierd_adam_set_group_hyper(self._handle, b.slot, ctypes.byref(hyper)))
        _check(lib.tierd_adam_begin_step(self._handle, grad_scale))
        self._begun = True

    def _launch(self, b: _Bucket):
        if not self._begun:  # during backward: speculating, at the last step's loss scale
            self._begin(self._spec_scale if self._speculate else 1.0)
        if b.event is not None:
            b.event.synchronize()
        _check(_library().tierd_adam_step_group(
            self._handle, b.slot, ctypes.c_void_p(b.grad.data_ptr()), _DTYPES[b.dtype],
            ctypes.c_void_p(b.out.data_ptr()), _DTYPES[b.dtype]))
        b.launched = True

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
        if not grad_scale > 0 or math.isinf(grad_scale):
            raise ValueError(f"grad_scale must be finite and > 0, not {grad_scale}")
        if grad_scale != 1.0 and self.overlap_backward and not self._speculate:
            self._abandon()
            raise RuntimeError("OffloadedAdamW: buckets were stepped during backward, unscaled; "
                               "loss scaling with overlap_backward needs skip_nonfinite=True")
        # Gradients not handed over during backward are taken now.
        todo = []
        for b in self._buckets:
            if b.launched:
                continue
            if b.arrived < len(b.params):
                b.present = any(p.grad is not None for p in b.params)
                if not b.present and self._comm is None:
                    continue  # no gradient this step: left as it is
                for i in range(len(b.params)):
                    self._copy_grad(b, i)
            todo.append(b)
        if self._comm is not None:  # summed into their owners: this rank steps its own
            self._comm.reduce_ready(self._buckets, force=True)
            todo = list(self._comm.reduced([b for b in todo if b.slot is not None], wait=True))
        for b in todo:
            if b.event is not None:
                b.event.synchronize()
        # As GradScaler.unscale_: times the fp32 reciprocal.
        inv = torch.tensor(grad_scale, dtype=torch.float64).reciprocal().float()
        checks = self.max_grad_norm is not None or self.skip_nonfinite
        rolled_back, norm = False, None
        if checks and self._speculate:
            # One norm on every rank (a collective when sharded), of the gradients unscaled and
            # before anything changes them: it decides for every rank alike.
            norm = self._grad_norm(self._stepped() + todo, None if grad_scale == 1.0 else inv)
            self.last_grad_norm = float(norm)
            if self._begun and not self._speculation_holds(norm, grad_scale):
                # Discard the buckets stepped during backward and step them all again, exactly.
                # (When the speculation holds, the rest are stepped as those were.)
                _check(_library().tierd_adam_abandon_step(self._handle))
                self._begun = False
                self._early = 0
                todo = self._stepped() + todo
                for b in todo:
                    b.launched = False
                self.rolled_back_steps += 1
                rolled_back = True
        self._spec_scale = grad_scale
        if not self._begun:  # nothing stepped yet: unscale, skip or clip, then step
            if grad_scale != 1.0:
                for b in todo:
                    b.grad.mul_(inv)
            if checks:
                if norm is None:
                    norm = self._grad_norm(todo)
                self.last_grad_norm = float(norm)
                if self.skip_nonfinite and not math.isfinite(self.last_grad_norm):
                    self.skipped_steps += 1
                    self._end_step()
                    self.last_stats = {"skipped": 1.0, "rolled_back": float(rolled_back),
                                       "tail_s": time.perf_counter() - start}
                    return loss
                if self.max_grad_norm is not None:
                    coef = self._clip_coefficient(norm)
                    for b in todo:
                        b.grad.mul_(coef)
            self._begin(1.0)
        for b in todo:
            self._launch(b)
        early = self._early
        reduces_early = self._comm.early if self._comm is not None else 0
        stats = _abi.AdamStepStats()
        try:
            _check(_library().tierd_adam_finish_step(self._handle, ctypes.byref(stats)))
        finally:
            self._end_step()
        self._write_weights()
        self.last_stats = {
            "step": float(stats.step), "wall_s": stats.wall_ns / 1e9,
            "compute_s": stats.compute_ns / 1e9, "state_wait_s": stats.state_wait_ns / 1e9,
            "write_wait_s": stats.write_wait_ns / 1e9, "state_bytes": float(stats.state_bytes),
            "buckets": float(len(self._owned)), "buckets_during_backward": float(early),
            "reduces_during_backward": float(reduces_early), "rolled_back": float(rolled_back),
            "tail_s": time.perf_counter() - start}
        return loss

    def _stepped(self) -> List[_Bucket]:
        """The buckets given to the optimizer this step (during backward)."""
        return [b for b in (self._buckets if self._comm is None else self._owned) if b.launched]

    def _speculation_holds(self, norm: torch.Tensor, grad_scale: float) -> bool:
        """Whether the buckets stepped during backward were stepped as the whole step's gradients
        (of global norm `norm`, unscaled) say they must be: at this loss scale, neither clipped
        (a coefficient of exactly 1, as clip_grad_norm_ computes it) nor skipped."""
        if grad_scale != self._spec_scale or not math.isfinite(float(norm)):
            return False  # another scale; or skipped, or clipped by a non-finite norm
        return self.max_grad_norm is None or float(self._clip_coefficient(norm)) == 1.0

    def _clip_coefficient(self, norm: torch.Tensor) -> torch.Tensor:
        # As clip_grad_norm_ computes it.
        return torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)

    def _grad_norm(self, buckets: List[_Bucket], inv: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
        # As clip_grad_norm_: each gradient's 2-norm, then the norm of those (of the gradients
        # times `inv` when given, as unscaling them would make them).
        norms = [torch.norm(g if inv is None else g * inv, 2.0)
                 for b in buckets for _, g in b.slices(b.grad)]
        if self._comm is not None:
            return self._comm.grad_norm(norms)
        if not norms:
            return torch.zeros(())
        return torch.norm(torch.stack(norms), 2.0)

    def _write_weights(self):
        # The last step's copies out of `out` were waited for in _begin, before this step wrote it.
        if self._comm is not None:
            new = self._comm.broadcast_weights(self._buckets)
        else:
            new = [b for b in self._buckets if b.launched]
        for b in new:
            for p, values in b.slices(b.out):
                p.copy_(values.view_as(p), non_blocking=p.is_cuda)
        if any(b.device.type == "cuda" for b in self._buckets):
            self._pending_copy = torch.cuda.Event()
            self._pending_copy.record()
        for b in self._buckets:
            b.launched = False

    def _end_step(self):
        self._begun = False
        self._early = 0
        if self._comm is not None:
            self._comm.end_step()
        for b in self._buckets:
            b.arrived = 0
            b.present = False
            b.event = None
        if self.overlap_backward:
            for key in self._counts:
                self._counts[key] = 0

    def _abandon(self):
        """Ends a step begun during backward without applying more (after an error): abandoned
        when speculative, else finished with what it applied."""
        if self._begun:
            try:
                if self._speculate:
                    _check(_library().tierd_adam_abandon_step(self._handle))
                else:
                    _check(_library().tierd_adam_finish_step(self._handle, None))
            finally:
                self._end_step()
                for b in self._buckets:
                    b.launched = False

    # ---- state ----

    @property
    def steps_taken(self) -> int:
        return int(_library().tierd_adam_steps_taken(self._handle))

    @property
    def state_bytes(self) -> int:
        return int(_library().tierd_adam_state_bytes(self._handle))

    def _read(self, b: _Bucket, part: int) -> torch.Tensor:
        out = torch.empty(b.numel, dtype=torch.float32)
        _check(_library().tierd_adam_get_state(self._handle, b.slot, part,
                                               ctypes.c_void_p(out.data_ptr()), b.numel))
        return out

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim.AdamW's format (exp_avg, exp_avg_sq and step per parameter, as fp32 CPU
        tensors), plus `master` (the fp32 master weights) for parameters kept in another dtype.
        Sharded over ranks, `state` holds this rank's parameters: the union of the ranks' `state`
        dicts is the whole (each rank's can be loaded back into the rank that owns it, or the
        union into every rank)."""
        if self._begun:
            raise RuntimeError("state_dict during a step")
        index = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append(packed)
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        steps = self.steps_taken
        if steps > 0:
            for b in self._owned:
                m, v = self._read(b, _abi.ADAM_M), self._read(b, _abi.ADAM_V)
                master = self._read(b, _abi.ADAM_PARAMS) if b.dtype != torch.float32 else None
                for i, p in enumerate(b.params):
                    off, n = b.offsets[i], p.numel()
                    entry = {"step": torch.tensor(float(steps)),
                             "exp_avg": m[off:off + n].view_as(p).clone(),
                             "exp_avg_sq": v[off:off + n].view_as(p).clone()}
                    if master is not None:
                        entry["master"] = master[off:off + n].view_as(p).clone()
                    state[index[id(p)]] = entry
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state_dict of this class or of torch.optim.AdamW (the model's weights must be
        loaded first: they become the master weights unless the state carries `master`).
        Sharded over ranks, each rank loads the parameters it owns."""
        if self._begun:
            raise RuntimeError("load_state_dict during a step")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict's parameter groups do not match the optimizer's")
        if any(s.get("amsgrad") for s in saved_groups):
            raise ValueError("loaded state dict is of an amsgrad AdamW, which this optimizer "
                             "does not implement")
        owned = {id(p) for b in self._owned for p in b.params}
        by_param = {}
        for s, g in zip(saved_groups, self.param_groups):
            for saved_id, p in zip(s["params"], g["params"]):
                if id(p) in owned:
                    by_param[id(p)] = state_dict["state"].get(saved_id, {})
        steps = {int(torch.as_tensor(e["step"]).item()) for e in by_param.values() if "step" in e}
        if len(steps) > 1:
            raise ValueError(f"parameters were stepped different numbers of times: {sorted(steps)}"
                             "; OffloadedAdamW steps every parameter together")
        lib = _library()
        for b in self._owned:
            parts = {"master": [], "exp_avg": [], "exp_avg_sq": []}
            for p in b.params:
                entry = by_param[id(p)]
                for key in parts:
                    value = entry.get(key)
                    if value is None:
                        value = p.detach() if key == "master" else torch.zeros_like(
                            p, dtype=torch.float32)
                    if value.shape != p.shape:
                        raise ValueError(f"state {key} of shape {tuple(value.shape)} for a "
                                         f"parameter of shape {tuple(p.shape)}")
                    parts[key].append(value.reshape(-1).to("cpu", torch.float32))
            flat = {k: torch.cat(v) for k, v in parts.items()}
            _check(lib.tierd_adam_set_state(
                self._handle, b.slot, ctypes.c_void_p(flat["master"].data_ptr()),
                ctypes.c_void_p(flat["exp_avg"].data_ptr()),
                ctypes.c_void_p(flat["exp_avg_sq"].data_ptr()), b.numel))
        _check(lib.tierd_adam_set_steps(self._handle, steps.pop() if steps else 0))
        for s, g in zip(saved_groups, self.param_groups):
            for key, value in s.items():
                if key != "params":
                    g[key] = tuple(value) if key == "betas" else value

    # ---- lifetime ----

    def close(self) -> None:
        """Ends the optimizer's session (scratch state is freed; persistent state stays)."""
        for h in self._hooks:
            (h[1] if isinstance(h, tuple) else h).remove()
        self._hooks = []
        if self._handle:
            try:
                self._abandon()
            except TierdError:
                pass
            _library().tierd_adam_destroy(self._handle)
            self._handle = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        moments = "bf16 moments, " if self.state_dtype == torch.bfloat16 else ""
        return (f"OffloadedAdamW({len(self._buckets)} buckets, {moments}{self.home} home, "
                f"{'persistent' if self.persistent else 'scratch'})")
