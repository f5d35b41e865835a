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
import concurrent.futures
import math
import os
import socket
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils.dlpack

from . import _abi, _adam, _buckets, _checkpoint, _shard, streaming
from .activations import ActivationOffload, ActivationStats, offload_activations
from .client import Acquisition, Tier, TierdError, connect
from .streaming import ParameterStream, stream_parameters

__all__ = ["ActivationOffload", "ActivationStats", "OffloadedAdamW", "ParameterStream",
           "as_tensor", "offload_activations", "stream_parameters"]


def as_tensor(acquisition: Acquisition, i: int, dtype: torch.dtype = torch.uint8,
              shape: Optional[List[int]] = None, offset: int = 0) -> torch.Tensor:
    """A torch tensor viewing chunk i of an acquisition without a copy (DLPack): CPU memory for a
    host chunk, CUDA memory for a device chunk. The chunk cannot be released while the tensor (or
    any view of its storage) lives."""
    name = str(dtype).replace("torch.", "")  # torch.float32 -> "float32", as the views name them
    return torch.utils.dlpack.from_dlpack(acquisition.dlpack(i, name, shape, offset))

_DEFAULT_BUCKET_PARAMS = 4 << 20
_STEP, _TAKE = _abi.ADAM_TENSOR_STEP, _abi.ADAM_TENSOR_TAKE_WEIGHTS


def _hyper(group: Dict[str, Any]) -> _abi.AdamHyper:
    """A parameter group's (or the defaults') hyperparameters for the C ABI: AdamW's decay."""
    return _abi.AdamHyper(group["lr"], group["betas"][0], group["betas"][1], group["eps"],
                          group["weight_decay"], 1)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


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
        self._adam: Optional[_adam.Adam] = None  # before anything that can fail: close() reads it
        self._hooks: Dict[int, Any] = {}
        self._handing = None  # the hand-over thread (made at the first complete bucket)
        self._handed: List[Any] = []  # its work of this step
        self._settle_queued = False  # an end-of-backward callback waits for it
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.overlap_backward = overlap_backward
        self.accumulation_steps = accumulation_steps
        self.bucket_params = bucket_params
        self.last_grad_norm: Optional[float] = None
        self.last_stats: Dict[str, float] = {}
        self.skipped_steps = 0
        # Buckets stepped during backward, before the global norm is known, into a second version
        # of the state (kept, or abandoned at step()); the loss scale they assumed.
        self._speculate = overlap_backward and (max_grad_norm is not None or skip_nonfinite)
        self._spec_scale = 1.0
        self.rolled_back_steps = 0
        self._begun = False
        self._pending_copy = None  # the last step's copies into GPU weights
        self._early = 0  # buckets given to the optimizer during this step's backward
        self._counts: Dict[int, int] = {}  # backward passes that gave each parameter a gradient
        self._prepared = False  # this step's bookkeeping is done (at its first gradient)

        # Every parameter's place: id -> (bucket, slot); the layout of the groups it reflects.
        self._where: Dict[int, Tuple[_buckets.Bucket, int]] = {}
        wanted = self._wanted()
        self._buckets = _buckets.plan(wanted, bucket_params, 0)
        _arrange_streams(self._buckets)
        self._layout = self._signature()
        self._comm = _shard.Comm.create(process_group)
        if self._comm is not None:
            self._comm.assign(self._buckets, [])
        else:
            for j, b in enumerate(self._buckets):
                b.slot = j
        self._owned = [b for b in self._buckets if b.slot is not None]
        for b in self._buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        if name is None and (resume or reset):
            raise ValueError("resume and reset need a name")
        # Each rank opens its share of the state in its own node's daemon. One that cannot (no
        # daemon on its node) must not leave the others waiting in a collective: all learn it.
        failed = None
        try:
            self._open_state(name, socket_dir, home, host_budget_bytes, threads, resume, reset)
        except Exception as e:  # noqa: BLE001 (re-raised here or by all_succeeded)
            failed = e
        if self._comm is None:
            if failed is not None:
                raise failed
        else:
            try:
                self._comm.all_succeeded("open the optimizer's state", failed)
                self._comm.agree("whether the state was resumed", int(self.resumed))
                self._comm.agree("the steps taken", self.steps_taken)
            except BaseException:
                self.close()
                raise
            self._comm.share_params(self._buckets)
        for b in self._buckets:
            b.mirror()
        if overlap_backward:
            self._install_hooks()

    # ---- construction ----

    def _open_state(self, name, socket_dir, home, host_budget_bytes, threads, resume, reset):
        """Picks the state's home tier when not given (NVMe when the state outgrows the host
        budget and the daemon has NVMe), then opens the state (_open)."""
        per_param = 8 if self.state_dtype == torch.bfloat16 else 12
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
                          "stops", RuntimeWarning, stacklevel=3)
        self.home = home
        try:
            self._open(name, socket_dir, home, host_budget_bytes, threads, resume, reset)
        except TierdError as e:
            if not (resume and e.code == _abi.Status.NOT_FOUND):
                raise
            raise TierdError(e.code, (
                f"{e.message}; the daemon on {socket.gethostname()} does not have it. A job's "
                "state lives in the daemons of the nodes whose ranks made it, a share per rank "
                "(<name>.rank<r>of<n>); a job that moved to other nodes, or runs on another "
                "number of ranks, resumes from its checkpoint instead: make the optimizer with "
                "reset=True and call load_checkpoint(directory) on every rank")) from None

    def _wanted(self) -> List[Tuple[int, Dict[str, Any], torch.Tensor]]:
        """(group index, group, parameter) for every parameter in the groups, checked as
        torch.optim checks them."""
        seen = set()
        out = []
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) in seen:
                    raise ValueError("some parameters appear in more than one parameter group")
                seen.add(id(p))
                _buckets.check_dtype(p)
                out.append((gi, g, p))
        return out

    def _signature(self):
        return tuple((id(g), tuple(id(p) for p in g["params"])) for g in self.param_groups)

    def _open(self, name, socket_dir, home, host_budget_bytes, threads, resume, reset):
        options = _adam.Adam.options()
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
        options.state_dtype = _buckets.DTYPES[self.state_dtype]
        options.speculative = 1 if self._speculate else 0
        options.hyper = _hyper(self.defaults)
        self._adam = _adam.Adam(self._owned, options)
        self.resumed = self._adam.resumed
        self._initialize(self._owned, {})

    def _initialize(self, buckets: List[_buckets.Bucket], moved: Dict[int, Dict[str, Any]]):
        """Gives the owned `buckets`, just made, their state: resumed state sets the model's
        weights; otherwise the model's weights become the master weights, with the state of any
        parameter in `moved` (id -> master, exp_avg, exp_avg_sq, step) carried over."""
        for b in buckets:
            if self._adam.initialized(b.slot):  # resumed
                b.set_weights(self._read(b, _abi.ADAM_PARAMS))
                continue
            parts = {"master": [], "exp_avg": [], "exp_avg_sq": []}
            steps = []
            for i, p in enumerate(b.params):
                state = moved.get(id(p), {})
                for key in parts:
                    value = state.get(key)
                    if value is None:
                        value = b.weight(i) if key == "master" else torch.zeros_like(
                            p, dtype=torch.float32)
                    parts[key].append(value.reshape(-1).to("cpu", torch.float32))
                steps.append(int(state.get("step", 0)))
            self._set_state(b, parts, steps)

    def _set_state(self, b: _buckets.Bucket, parts: Dict[str, List[torch.Tensor]],
                   steps: List[int]):
        flat = {k: torch.cat(v) if v else torch.zeros(0) for k, v in parts.items()}
        self._adam.set_state(b.slot, _ptr(flat["master"]), _ptr(flat["exp_avg"]),
                             _ptr(flat["exp_avg_sq"]), b.numel)
        self._adam.set_tensor_steps(b.slot, steps)

    # ---- the parameter groups, as they are now ----

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's add_param_group; the group's state is made (or, for persistent state that
        recorded it, resumed, setting its weights) at once."""
        super().add_param_group(param_group)
        if getattr(self, "_adam", None) is None or self._begun:
            return  # torch's __init__ adding the first groups; or refused at step()
        try:
            self._sync()
        except (TypeError, ValueError):
            self.param_groups.pop()  # refused: as if never added
            raise
        if self.overlap_backward:
            self._install_hooks()

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """torch's zero_grad; params lists edited since the last step are taken in first (their
        state made, or resumed, before the forward pass that uses them)."""
        self._settle()
        if not self._begun:
            self._sync()
            if self.overlap_backward:
                self._install_hooks()
        if set_to_none is None:
            super().zero_grad()
        else:
            super().zero_grad(set_to_none=set_to_none)

    def _sync(self):
        """Makes the buckets follow the parameter groups (add_param_group, params lists edited,
        a parameter's dtype or device changed) and frees the state of parameters that are gone.
        Between steps only."""
        if self._signature() != self._layout:
            self._relayout()
        dead = [b for b in self._buckets if self._dead(b)]
        if dead:
            self._remove(dead)

    def _dead(self, b: _buckets.Bucket) -> bool:
        """Dormant, and no slot is the place of a parameter still alive (each is gone, or was
        moved to another bucket): its state can go."""
        if b.params is not None:
            return False
        for i in range(len(b.sizes)):
            p = b.param(i)
            if p is not None and self._where.get(id(p)) == (b, i):
                return False
        return True

    def _relayout(self):
        wanted = self._wanted()
        keep, moves = [], []
        for gi, g, p in wanted:
            place = self._where.get(id(p))
            b, i = place if place is not None else (None, None)
            if b is not None and b.param(i) is not p:
                b = None  # an id reused by another tensor
            if b is not None and b.sizes[i] != p.numel():
                raise ValueError(f"OffloadedAdamW: a parameter of {b.sizes[i]} elements now has "
                                 f"{p.numel()}; its state cannot follow a change of shape")
            if b is not None and b.group is g and b.dtype == p.dtype and b.device == p.device:
                keep.append((b, i))
            else:
                moves.append((gi, g, p, b, i))
        if any(streaming.stream_of(m[2]) is not None for m in moves):
            raise ValueError("OffloadedAdamW: a streamed parameter (stream_parameters) joined or "
                             "moved between parameter groups after the optimizer was made: give "
                             "the constructor every streamed parameter, in its final group")
        carried = [m for m in moves if m[3] is not None]
        if carried and self._comm is not None:
            raise RuntimeError("OffloadedAdamW: sharded over ranks, a parameter with state "
                               "cannot move to another parameter group, dtype or device (its "
                               "state would change owner); add new parameters only")
        moved, read = {}, {}
        for _, _, p, b, i in carried:  # read before anything changes
            moved[id(p)] = self._state_of(b, i, read)
        for b in self._buckets:
            b.live = [False] * len(b.sizes)
        for b, i in keep:
            b.wake()
            b.live[i] = True
        new = _buckets.plan([(gi, g, p) for gi, g, p, _, _ in moves], self.bucket_params,
                            self._next_serial())
        if new:
            if self._comm is not None:
                self._comm.assign(new, [b for b in self._buckets if b.active])
            else:
                for b in new:
                    b.slot = 0  # renumbered below
            owned = [b for b in new if b.slot is not None]
            for j, b in enumerate(owned):
                b.slot = len(self._owned) + j
            self._adam.add_groups(owned)
            self._owned += owned
            self._buckets += new
            for b in new:
                for i, p in enumerate(b.params):
                    self._where[id(p)] = (b, i)
            self._initialize(owned, moved)
            if self._comm is not None:
                self._comm.share_params(new)
            for b in new:
                b.mirror()
        for b in self._buckets:
            if b.params is not None and not any(b.live):
                b.go_dormant()
        self._layout = self._signature()

    def _next_serial(self) -> int:
        return 1 + max((b.serial for b in self._buckets), default=-1)

    def _state_of(self, b: _buckets.Bucket, i: int, read: Dict[int, Any]) -> Dict[str, Any]:
        """Slot i's state: master, exp_avg, exp_avg_sq (flat fp32) and step (each bucket read
        once into `read`)."""
        if b.slot is None:
            return {}
        if b.serial not in read:
            read[b.serial] = self._read_all(b)
        parts, steps = read[b.serial]
        state = {key: b.slice(flat, i) for key, flat in parts.items()}
        state["step"] = steps[i]
        return state

    def _read_all(self, b: _buckets.Bucket) -> Tuple[Dict[str, torch.Tensor], List[int]]:
        """b's whole state: master, exp_avg and exp_avg_sq (flat fp32), and each tensor's step."""
        parts = {key: self._read(b, part) for key, part in
                 (("master", _abi.ADAM_PARAMS), ("exp_avg", _abi.ADAM_M),
                  ("exp_avg_sq", _abi.ADAM_V))}
        return parts, self._tensor_steps(b)

    def _remove(self, buckets: List[_buckets.Bucket]):
        """Frees the state of `buckets` (dormant, their parameters gone)."""
        owned = [b for b in buckets if b.slot is not None]
        if owned:
            self._adam.remove_groups([b.slot for b in owned])
        gone = set(id(b) for b in buckets)
        self._buckets = [b for b in self._buckets if id(b) not in gone]
        self._owned = [b for b in self._owned if id(b) not in gone]
        for j, b in enumerate(self._owned):
            b.slot = j
        self._where = {k: v for k, v in self._where.items() if id(v[0]) not in gone}

    def _active(self) -> List[_buckets.Bucket]:
        """The buckets with a parameter in the groups, in the order they were made."""
        return [b for b in self._buckets if b.active]

    # ---- gradients in ----

    @torch.enable_grad()
    def _install_hooks(self):
        for g in self.param_groups:
            for p in g["params"]:
                if not p.requires_grad or id(p) in self._hooks:
                    continue
                key = id(p)
                if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                    self._hooks[key] = p.register_post_accumulate_grad_hook(
                        lambda param, key=key: self._on_grad(key))
                else:  # torch 1.13: a hook on the parameter's gradient accumulator
                    acc = streaming.grad_accumulator(p)
                    handle = acc.register_hook(lambda *_, key=key: self._on_grad(key))
                    self._hooks[key] = (acc, handle)

    def _prepare(self):
        """The step's bookkeeping, at its first gradient: the groups as they are now, and how
        many gradients each bucket awaits (its live parameters that require one)."""
        self._prepared = True
        if not self._begun:
            self._sync()
        for b in self._active():
            trainable = [p for i, p in enumerate(b.params) if b.live[i] and p.requires_grad]
            b.expected = sum(1 for p in trainable if id(p) in self._hooks)
            if not trainable:  # frozen: nothing to wait for (nor to hold later buckets up)
                self._complete(b)

    def _on_grad(self, key: int):
        if not self._prepared:
            self._prepare()
        if not self._settle_queued:  # backward's end waits for what it handed over
            self._settle_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        place = self._where.get(key)
        if place is None:
            return
        b, i = place
        if not b.active or not b.live[i] or id(b.params[i]) != key:
            return
        self._counts[key] = self._counts.get(key, 0) + 1
        count = self._counts[key]
        if isinstance(b, _buckets.StreamBucket):
            # Each pass's gradient leaves the device at once, summed into the bucket's.
            if b.launched or count > self.accumulation_steps:
                return
            self._copy_grad(b, i, add=count > 1)
            if count < self.accumulation_steps:
                return
        else:
            if count < self.accumulation_steps or b.launched or b.got[i]:
                return
            self._copy_grad(b, i)
        b.arrived += 1
        if b.arrived < b.expected:
            return
        self._complete(b)  # the rest: frozen parameters that still hold a gradient
        # The rest waits for the bucket's copies off the GPU: on the hand-over thread, so that
        # autograd's thread goes on with backward (and waits for it only at backward's end).
        if self._handing is None:
            self._handing = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tierd-hand-over")
        self._handed.append(self._handing.submit(self._hand_over, b))

    def _hand_over(self, b: _buckets.Bucket):
        """Steps the complete bucket b (sharded: issues the reduces in order, and steps this
        rank's buckets whose sums are in). On the hand-over thread, in completion order."""
        if self._comm is None:
            if self._steps_early() and self._flag(b):
                self._launch(b)
                self._early += 1
            return
        self._comm.reduce_ready(self._active())
        if self._steps_early():  # this rank's buckets whose gradients are summed by now
            for owned in self._comm.reduced(self._owned, wait=False):
                if self._flag(owned):
                    self._launch(owned)
                    self._early += 1

    def _end_backward(self):
        self._settle_queued = False
        self._settle()

    def _settle(self):
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

    def _complete(self, b: _buckets.Bucket):
        """Takes the gradients of b's live parameters not taken yet: those that have one now
        (torch steps a parameter whose .grad is not None), zeros for the others when sharded
        (the ranks' buffers are summed)."""
        if b.complete:
            return
        for i in range(len(b.sizes)):
            if b.got[i] or not b.live[i]:
                continue
            if b.params[i].grad is not None:
                self._copy_grad(b, i)
            elif self._comm is not None:
                b.need_grad()
                b.slice(b.grad, i).zero_()
        b.has = list(b.got)
        b.complete = True

    def _copy_grad(self, b: _buckets.Bucket, i: int, add: bool = False):
        """Takes p.grad into the bucket's gradients (`add`: summed into what is there)."""
        b.need_grad()
        p, dst = b.params[i], b.slice(b.grad, i)
        b.got[i] = True
        g = p.grad.detach().reshape(-1)
        if add:
            if b.event is not None:
                b.event.synchronize()
            dst.add_(g.to("cpu"))
        elif p.grad.is_cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(stream):
                dst.copy_(g, non_blocking=True)
                p.grad.record_stream(stream)
                b.event = torch.cuda.Event()
                b.event.record(stream)
        else:
            dst.copy_(g)
        b.drop_grad(i)

    def _side_stream(self):
        if getattr(self, "_stream", None) is None:
            self._stream = torch.cuda.Stream(self._buckets[0].device)
        return self._stream

    def _steps_early(self) -> bool:
        return self._speculate or (self.max_grad_norm is None and not self.skip_nonfinite)

    def _flag(self, b: _buckets.Bucket) -> bool:
        """Sets b's flags for its step: stepped where a gradient is present, weights taken where
        the caller changed them. Whether there is anything to do."""
        anything = False
        for i in range(len(b.sizes)):
            f = 0
            if b.live[i]:
                b.flagged[i] = (b.params[i]._version, b.params[i].data_ptr())
                if b.has[i]:
                    f |= _STEP
                if b.changed(i):
                    f |= _TAKE
                    if b.weights is None:
                        b.weights = torch.empty(b.numel, dtype=torch.float32)
                    b.slice(b.weights, i).copy_(b.weight(i))
            b.flags[i] = f
            anything = anything or f != 0
        return anything

    def _begin(self, grad_scale: float):
        if self._pending_copy is not None:  # last step's weights copied out of `out` buffers
            self._pending_copy.synchronize()
            self._pending_copy = None
        for b in self._owned:
            self._adam.set_group_hyper(b.slot, _hyper(b.group))
        self._adam.begin_step(grad_scale)
        self._begun = True

    def _launch(self, b: _buckets.Bucket):
        if not self._begun:  # during backward: speculating, at the last step's loss scale
            self._begin(self._spec_scale if self._speculate else 1.0)
        if b.event is not None:
            b.event.synchronize()
        b.bind()
        self._adam.step_tensors(b.slot, _ptr(b.grad), _buckets.DTYPES[b.dtype], _ptr(b.out),
                                _buckets.DTYPES[b.dtype], b.flags, len(b.sizes),
                                _ptr(b.weights))
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
        try:
            self._settle()
        except BaseException:
            self._abandon()
            raise
        if not grad_scale > 0 or math.isinf(grad_scale):
            raise ValueError(f"grad_scale must be finite and > 0, not {grad_scale}")
        if grad_scale != 1.0 and self.overlap_backward and not self._speculate:
            self._abandon()
            raise RuntimeError("OffloadedAdamW: buckets were stepped during backward, unscaled; "
                               "loss scaling with overlap_backward needs skip_nonfinite=True")
        if self._begun and self._signature() != self._layout:
            self._abandon()
            raise RuntimeError("OffloadedAdamW: the parameter groups changed between backward "
                               "and step(), while buckets were being stepped during backward: "
                               "change them between step() and the next backward")
        if self._begun and any(b.written_since_flagged() for b in self._stepped()):
            self._abandon()
            raise RuntimeError("OffloadedAdamW: weights changed between backward and step(), "
                               "after they were stepped during backward (overlap_backward): "
                               "change them between step() and the next backward")
        if not self._begun:
            self._sync()
        self._prepared = True
        # Gradients not handed over during backward are taken now.
        todo = []
        for b in self._active():
            if b.launched:
                continue
            self._complete(b)
            todo.append(b)
        if self._comm is not None:  # summed into their owners: this rank steps its own
            self._comm.reduce_ready(self._active(), force=True)
            todo = list(self._comm.reduced([b for b in todo if b.slot is not None], wait=True))
        todo = [b for b in todo if self._flag(b)]
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
                self._adam.abandon_step()
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
                    if b.grad is not None:
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
                        if b.grad is not None:
                            b.grad.mul_(coef)
            self._begin(1.0)
        for b in todo:
            self._launch(b)
        early = self._early
        reduces_early = self._comm.early if self._comm is not None else 0
        stats = _abi.AdamStepStats()
        try:
            self._adam.finish_step(stats)
        except BaseException:
            self._end_step()
            raise
        written = self._stepped()
        self._end_step(unbind=False)
        try:
            self._write_weights(written)
        finally:
            for b in self._buckets:
                b.unbind()
        self.last_stats = {
            "step": float(stats.step), "wall_s": stats.wall_ns / 1e9,
            "compute_s": stats.compute_ns / 1e9, "state_wait_s": stats.state_wait_ns / 1e9,
            "write_wait_s": stats.write_wait_ns / 1e9, "state_bytes": float(stats.state_bytes),
            "buckets": float(len([b for b in self._owned if b.active])),
            "buckets_during_backward": float(early),
            "reduces_during_backward": float(reduces_early), "rolled_back": float(rolled_back),
            "tail_s": time.perf_counter() - start}
        return loss

    def _stepped(self) -> List[_buckets.Bucket]:
        """The buckets given to the optimizer this step (during backward)."""
        return [b for b in (self._active() if self._comm is None else self._owned) if b.launched]

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

    def _grad_norm(self, buckets: List[_buckets.Bucket], inv: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
        # As clip_grad_norm_: each gradient's 2-norm (of the parameters that have one), then the
        # norm of those (of the gradients times `inv` when given, as unscaling them would make).
        # In the parameter groups' order (as clip_grad_norm_ over the model's parameters), not the
        # buckets': the norm is one float sum whatever the bucketing.
        order = {id(p): k for k, p in enumerate(p for g in self.param_groups
                                                for p in g["params"])}
        keyed = [(order.get(id(b.params[i]), len(order)), torch.norm(
                  values if inv is None else values * inv, 2.0))
                 for b in buckets if any(b.has)
                 for i, values in b.slices(b.grad) if b.has[i]]
        norms = [n for _, n in sorted(keyed, key=lambda kv: kv[0])]
        if self._comm is not None:
            return self._comm.grad_norm(norms)
        if not norms:
            return torch.zeros(())
        return torch.norm(torch.stack(norms), 2.0)

    def _write_weights(self, stepped: List[_buckets.Bucket]):
        # The last step's copies out of `out` were waited for in _begin, before this step wrote it.
        for b in stepped:  # weights only taken: `out` keeps them as the model has them
            for i, values in b.slices(b.out):
                if b.flags[i] == _TAKE:
                    values.copy_(b.weight(i))
        if self._comm is not None:
            for b in self._active():  # every bucket's new weights arrive into its `out`
                b.bind()
            new = self._comm.broadcast_weights(self._active(), stepped)
        else:
            new = [(b, [b.flags[i] for i in range(len(b.sizes))]) for b in stepped]
        for b, flags in new:
            b.publish(flags)
        if any(b.device.type == "cuda" for b in self._buckets):
            self._pending_copy = torch.cuda.Event()
            self._pending_copy.record()

    def _end_step(self, unbind: bool = True):
        self._begun = False
        self._early = 0
        self._prepared = False
        if self._comm is not None:
            self._comm.end_step()
        for b in self._buckets:
            if unbind:
                b.unbind()
            b.reset_step()
        self._counts.clear()
        if self.overlap_backward:  # parameters that now require a gradient
            self._install_hooks()

    def _abandon(self):
        """Ends a step begun during backward without applying more (after an error): abandoned
        when speculative, else finished with what it applied."""
        try:
            self._settle()
        except BaseException:  # noqa: B036 (the step is being given up already)
            pass
        if self._begun:
            try:
                if self._speculate:
                    self._adam.abandon_step()
                else:
                    self._adam.finish_step()
            finally:
                self._end_step()

    # ---- state ----

    @property
    def steps_taken(self) -> int:
        return self._adam.steps_taken

    @property
    def state_bytes(self) -> int:
        return self._adam.state_bytes

    def _read(self, b: _buckets.Bucket, part: int) -> torch.Tensor:
        out = torch.empty(b.numel, dtype=torch.float32)
        self._adam.get_state(b.slot, part, _ptr(out), b.numel)
        return out

    def _tensor_steps(self, b: _buckets.Bucket) -> List[int]:
        return self._adam.tensor_steps(b.slot, len(b.sizes))

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim.AdamW's format (exp_avg, exp_avg_sq and step per parameter stepped at
        least once, as fp32 CPU tensors), plus `master` (the fp32 master weights) for parameters
        kept in another dtype. Sharded over ranks, `state` holds this rank's parameters: the union
        of the ranks' `state` dicts is the whole (each rank's can be loaded back into the rank
        that owns it, or the union into every rank)."""
        self._settle()
        if self._begun:
            raise RuntimeError("state_dict during a step")
        self._sync()
        index = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append(packed)
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for b in self._owned:
            if not b.active:
                continue
            steps = self._tensor_steps(b)
            if not any(steps[i] for i in range(len(steps)) if b.live[i]):
                continue
            m, v = self._read(b, _abi.ADAM_M), self._read(b, _abi.ADAM_V)
            master = self._read(b, _abi.ADAM_PARAMS) if b.dtype != torch.float32 else None
            for i, p in enumerate(b.params):
                if not b.live[i] or steps[i] == 0:
                    continue  # as torch: no state for a parameter never stepped
                entry = {"step": torch.tensor(float(steps[i])),
                         "exp_avg": b.slice(m, i).view_as(p).clone(),
                         "exp_avg_sq": b.slice(v, i).view_as(p).clone()}
                if master is not None:  # the weights as the model has them, if changed since
                    entry["master"] = (b.weight(i).float().view(p.shape) if b.changed(i)
                                       else b.slice(master, i).view_as(p).clone())
                state[index[id(p)]] = entry
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state_dict of this class or of torch.optim.AdamW (the model's weights must be
        loaded first: they become the master weights unless the state carries `master`), each
        parameter with its own step count. Sharded over ranks, each rank loads the parameters it
        owns."""
        self._settle()
        if self._begun:
            raise RuntimeError("load_state_dict during a step")
        self._sync()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict's parameter groups do not match the optimizer's")
        if any(s.get("amsgrad") for s in saved_groups):
            raise ValueError("loaded state dict is of an amsgrad AdamW, which this optimizer "
                             "does not implement")
        by_param = {}
        for s, g in zip(saved_groups, self.param_groups):
            for saved_id, p in zip(s["params"], g["params"]):
                by_param[id(p)] = state_dict["state"].get(saved_id, {})
        for entry in by_param.values():
            for key in ("exp_avg", "exp_avg_sq", "master"):
                value = entry.get(key)
                if value is not None and not torch.is_tensor(value):
                    raise ValueError(f"state {key} is not a tensor")
        # Everything is read and checked before anything is written.
        plans = []
        for b in self._owned:
            if not b.active:
                continue
            current, current_steps = None, None
            if not all(b.live):  # slots of parameters no longer in the groups keep their state
                current, current_steps = self._read_all(b)
            parts = {"master": [], "exp_avg": [], "exp_avg_sq": []}
            steps = []
            for i, p in enumerate(b.params):
                if not b.live[i]:
                    for key in parts:
                        parts[key].append(b.slice(current[key], i))
                    steps.append(current_steps[i])
                    continue
                entry = by_param[id(p)]
                for key in parts:
                    value = entry.get(key)
                    if value is None:
                        value = b.weight(i).view(p.shape) if key == "master" else (
                            torch.zeros_like(p, dtype=torch.float32))
                    if value.shape != p.shape:
                        raise ValueError(f"state {key} of shape {tuple(value.shape)} for a "
                                         f"parameter of shape {tuple(p.shape)}")
                    parts[key].append(value.reshape(-1).to("cpu", torch.float32))
                steps.append(int(torch.as_tensor(entry.get("step", 0)).item()))
                if steps[-1] < 0:
                    raise ValueError(f"state step {steps[-1]} < 0")
            plans.append((b, parts, steps))
        dormant = [(b, self._tensor_steps(b)) for b in self._owned if not b.active]
        everything = [int(torch.as_tensor(e["step"]).item()) for e in by_param.values()
                      if "step" in e]
        # steps_taken: the most any parameter has taken (each keeps its own count, set after).
        self._adam.set_steps(max(everything, default=0))
        for b, parts, steps in plans:
            self._set_state(b, parts, steps)
        for b, steps in dormant:
            self._adam.set_tensor_steps(b.slot, steps)
        for s, g in zip(saved_groups, self.param_groups):
            for key, value in s.items():
                if key != "params":
                    g[key] = tuple(value) if key == "betas" else value
        for b in self._buckets:
            b.mirror()

    # ---- checkpoints that move between nodes and world sizes ----

    def save_checkpoint(self, directory: str, format: Optional[str] = None) -> None:
        """Writes every rank's share of the state (its state_dict) to `directory`; call it on
        every rank. When it returns on any rank, every rank's share is written. load_checkpoint
        reads it into a job of any number of ranks, on any nodes.

        `format`: "dcp", a torch.distributed.checkpoint checkpoint (torch 2.2 and newer), or
        "torch", a torch.save file per rank (any torch); by default dcp where torch has it."""
        rank, world = (self._comm.rank, self._comm.world) if self._comm else (0, 1)
        group = self._comm.group if self._comm else None
        _checkpoint.save(directory, rank, world, self.state_name, self.state_dict(), format,
                         group)
        if self._comm is not None:
            self._comm.barrier()

    def load_checkpoint(self, directory: str) -> None:
        """Loads a checkpoint that save_checkpoint wrote, in either format, whatever number of
        ranks saved it: each rank reads the state of the parameters it owns now (the state
        resharded). Call it on every rank, after loading the model's weights, on an optimizer
        made afresh (reset=True) under the job's name."""
        group = self._comm.group if self._comm else None
        self.load_state_dict(_checkpoint.load(directory, self._owned_shapes(), group))

    def _owned_shapes(self) -> Dict[int, Tuple[int, ...]]:
        """The state_dict indices of the parameters this rank owns (all of them unsharded), with
        their shapes."""
        index = {}
        for g in self.param_groups:
            for p in g["params"]:
                index.setdefault(id(p), len(index))
        return {index[id(p)]: tuple(p.shape) for b in self._owned for i, p in enumerate(b.params)
                if b.live[i] and id(p) in index}

    # ---- lifetime ----

    def close(self) -> None:
        """Ends the optimizer's session (scratch state is freed; persistent state stays)."""
        if getattr(self, "_handing", None) is not None:
            self._abandon()
            self._handing.shutdown()
            self._handing = None
        for h in self._hooks.values():
            (h[1] if isinstance(h, tuple) else h).remove()
        self._hooks = {}
        if self._adam is not None:
            try:
                self._abandon()
            except TierdError:
                pass
            self._adam.close()
            self._adam = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        moments = "bf16 moments, " if self.state_dtype == torch.bfloat16 else ""
        return (f"OffloadedAdamW({len(self._buckets)} buckets, {moments}{self.home} home, "
                f"{'persistent' if self.persistent else 'scratch'})")


def _arrange_streams(buckets: List[_buckets.Bucket]) -> None:
    """Lays each streamed unit out as the buckets of its parameters (one range each, the rest of
    its parameters after them), then gives those buckets their gradient buffers."""
    layouts: Dict[Any, Dict[int, List[List[torch.Tensor]]]] = {}
    streams = {}
    for b in buckets:
        if isinstance(b, _buckets.StreamBucket):
            u = b.stream.unit_of(b.params[0])
            streams[id(b.stream)] = b.stream
            layouts.setdefault(id(b.stream), {}).setdefault(u.index, []).append(list(b.params))
    for key, layout in layouts.items():
        stream = streams[key]
        for index, groups in layout.items():
            taken = {id(p) for g in groups for p in g}
            rest = [p for p in stream._units[index].params if id(p) not in taken]
            for dtype in streaming._DTYPES:
                left = [p for p in rest if p.dtype == dtype]
                if left:
                    groups.append(left)
        stream.arrange(layout, 1)
    for b in buckets:
        if isinstance(b, _buckets.StreamBucket):
            b.attach()
