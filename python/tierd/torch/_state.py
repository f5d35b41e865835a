"""OffloadedAdamW's state record: its buckets' master weights, moments and step counts in the
client library's out-of-core optimizer (_adam.Adam), read and written as torch tensors, and
torch.optim.AdamW's state_dict made from it and loaded into it.

Each owned bucket is one tierd group (its `slot`), each of its parameters one tensor of that group
with its own step count. Everything a load writes is read and checked before anything is written.
"""
import os
import socket
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._errors import FailedPrecondition, InvalidArgument
from .. import _abi, _adam
from ..client import Tier, TierdError, TierUsage, connect
from ._buckets import Bucket
from ._lanes import DeviceLanes
from ._storage import STEPPED_DTYPES

_PARTS = (("master", _abi.ADAM_PARAMS), ("exp_avg", _abi.ADAM_M), ("exp_avg_sq", _abi.ADAM_V))


def hyper(group: Dict[str, Any]) -> _abi.AdamHyper:
    """A parameter group's (or the defaults') hyperparameters for the C ABI: AdamW's decay."""
    return _abi.AdamHyper(group["lr"], group["betas"][0], group["betas"][1], group["eps"],
                          group["weight_decay"], 1)


def rank_share(host: TierUsage) -> int:
    """The host tier's share of this job's rank on the node (LOCAL_WORLD_SIZE, as torchrun sets
    it)."""
    return host.capacity_bytes // max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


def host_budget(setting, host: TierUsage, streamed_bytes: int, scratch: bool) -> int:
    """host_budget_bytes as given, or for "auto" from the host tier's share of this rank
    (rank_share()). Where parameters are streamed (`streamed_bytes` of their weights), half of
    it, or less where those weights and an eighth of the share for what passes through would not
    fit in the other half: the rest of the share beyond them, and an eighth of it at the least.
    The weights then stay in the tier from one step to the next; with a larger budget the daemon
    drops them and the optimizer's kept shards both, for each other's room, and reads them all
    again. Else, for scratch state, as much of the share as is free now (an eighth of it at the
    least: other jobs' scratch copies go down for room), so that state that fits stays there and
    moves nothing; for persistent state all of it, so that a resumed run plans as the first did
    whatever the tier holds then."""
    if setting != "auto":
        return setting
    share = rank_share(host)
    if streamed_bytes:
        return max(share // 8, min(share // 2, share - streamed_bytes - share // 8))
    return max(min(share, host.free_bytes), share // 8) if scratch else share


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class OptimizerState:
    """The open state of one optimizer (one rank's share when sharded)."""

    def __init__(self, adam: _adam.Adam, name: str, persistent: bool, home: str,
                 host_budget_bytes: int, masters_in_out: bool, device_tier: bool):
        self.adam = adam
        self.name = name
        self.persistent = persistent
        self.home = home
        self.host_budget_bytes = host_budget_bytes  # "auto" resolved
        self.masters_in_out = masters_in_out
        self.device_tier = device_tier  # the daemon serves one (device_share can be set)
        self.lanes = DeviceLanes(None)  # where the buckets are stepped (OffloadedAdamW sets it)

    @staticmethod
    def masters(buckets: List[Bucket], in_out: bool, device_tier: bool) -> None:
        """Says where each bucket's master weights live, before its group is made: in its `out`
        where it can be (Bucket.out_can_be_master, beside the daemon's `device_tier` or not) and
        `in_out` allows (scratch state: persistent state must restore the weights it resumes),
        else in the state."""
        for b in buckets:
            b.master = (_abi.ADAM_MASTER_IN_OUT if in_out and b.out_can_be_master(device_tier)
                        else _abi.ADAM_MASTER_IN_STATE)

    def add_groups(self, buckets: List[Bucket]) -> None:
        """Gives buckets made after the state was opened their groups."""
        self.masters(buckets, self.masters_in_out, self.device_tier)
        self.adam.add_groups(buckets)

    @staticmethod
    def open(owned: List[Bucket], *, name: Optional[str], scratch_id: int, rank_suffix: str = "",
             socket_dir, home: Optional[str], host_budget_bytes, threads: int, resume,
             reset: bool, state_dtype: torch.dtype, speculative: bool, masters_in_out: bool,
             defaults: Dict[str, Any], device_budget_bytes: int = 0,
             streamed_bytes: int = 0) -> "OptimizerState":
        """Opens (creates or resumes) the state of the `owned` buckets. `home` None: NVMe when
        the state (twice that when speculative) outgrows host_budget_bytes (an int, or "auto":
        host_budget()) or the room the host tier has for it ("auto"'s share, and for scratch
        state what is free now: other jobs' state may be at home there), and the daemon has NVMe;
        else host. A persistent name is the job's, `rank_suffix` added per rank; scratch state is
        named by the process and `scratch_id`. `masters_in_out`: the buckets that can keep their
        master weights in their `out` do, if the state is scratch (masters()).
        `streamed_bytes`: the weights of the streamed parameters, which "auto" leaves room for."""
        masters_in_out = masters_in_out and name is None
        with connect(socket_dir, "optimizer-probe") as c:
            has_nvme = c.tier_usage(Tier.NVME).configured
            device_tier = c.tier_usage(Tier.DEVICE).configured
            host = c.tier_usage(Tier.HOST)
        if device_budget_bytes > 0 and not device_tier:
            raise FailedPrecondition("device_budget_bytes needs the daemon's device tier, and "
                                     "this daemon serves none")
        OptimizerState.masters(owned, masters_in_out, device_tier)
        moments = 4 if state_dtype == torch.bfloat16 else 8
        state_bytes = sum((moments + (b.master == _abi.ADAM_MASTER_IN_STATE) * 4) * b.numel
                          for b in owned)
        scratch = name is None
        budget = host_budget(host_budget_bytes, host, streamed_bytes, scratch)
        if home is None:
            # Within the budget and the room the tier has for it: state at home in the host tier
            # stays there, and beyond that room it would starve the stream's blocks (which then
            # wait for room that never frees) or other jobs. Persistent state is planned by the
            # tier's size alone, as it was when first made.
            held = state_bytes * (2 if speculative else 1)
            room = min(budget, host_budget("auto", host, streamed_bytes, scratch))
            if scratch:
                room = min(room, host.free_bytes)
            home = "host" if held <= room or not has_nvme else "nvme"
        share = rank_share(host)
        if home == "nvme" and budget > share:
            warnings.warn(f"OffloadedAdamW: host_budget_bytes {budget} is more than this rank's "
                          f"share of the daemon's host tier ({share} bytes): the "
                          "state it keeps there is dropped for room and read again each step; "
                          "\"auto\" sizes it from the tier", RuntimeWarning, stacklevel=4)
        if name is not None and not has_nvme:
            warnings.warn(f"OffloadedAdamW: state {name!r} is persistent, but the daemon has no "
                          "NVMe tier: it lives in host memory only and is lost when the daemon "
                          "stops", RuntimeWarning, stacklevel=4)
        options = _adam.Adam.options()
        if socket_dir:
            options.socket_dir = socket_dir.encode()
        persistent = name is not None
        full = (name or f"scratch-{os.getpid()}-{scratch_id:x}") + rank_suffix
        options.name = full.encode()
        options.persistent = 1 if persistent else 0
        options.reset = 1 if reset else 0
        options.open_mode = {None: _abi.ADAM_CREATE_OR_OPEN, True: _abi.ADAM_OPEN,
                             False: _abi.ADAM_CREATE}[resume]
        options.home_tier = _abi.TIER_NVME if home == "nvme" else _abi.TIER_HOST
        options.check_finite = 0  # the whole step is checked in Python, before any group steps
        options.threads = threads
        options.host_budget_bytes = budget
        options.state_dtype = STEPPED_DTYPES[state_dtype]
        options.speculative = 1 if speculative else 0
        options.device_budget_bytes = device_budget_bytes
        options.hyper = hyper(defaults)
        try:
            adam = _adam.Adam(owned, options)
        except TierdError as e:
            if not (resume and e.code == _abi.Status.NOT_FOUND):
                raise
            raise TierdError(e.code, (
                f"{e.message}; the daemon on {socket.gethostname()} does not have it. A job's "
                "state lives in the daemons of the nodes whose ranks made it, a share per rank "
                "(<name>.rank<r>of<n>); a job that moved to other nodes, or runs on another "
                "number of ranks, resumes from its checkpoint instead: make the optimizer with "
                "reset=True and call load_checkpoint(directory) on every rank")) from None
        return OptimizerState(adam, full, persistent, home, budget, masters_in_out, device_tier)

    @property
    def resumed(self) -> bool:
        return self.adam.resumed

    # ---- reading and writing ----

    def read(self, b: Bucket, part: int) -> torch.Tensor:
        if part == _abi.ADAM_PARAMS and b.master == _abi.ADAM_MASTER_IN_OUT:
            return torch.cat([b.weight(i).float() for i in range(len(b.sizes))] or
                             [torch.zeros(0)])  # the weights are the master
        out = torch.empty(b.numel, dtype=torch.float32)
        self.adam.get_state(b.slot, part, _ptr(out), b.numel)
        return out

    def tensor_steps(self, b: Bucket) -> List[int]:
        return self.adam.tensor_steps(b.slot, len(b.sizes))

    def read_all(self, b: Bucket) -> Tuple[Dict[str, torch.Tensor], List[int]]:
        """b's whole state: master, exp_avg and exp_avg_sq (flat fp32), and each tensor's step."""
        return {key: self.read(b, part) for key, part in _PARTS}, self.tensor_steps(b)

    def state_of(self, b: Bucket, i: int, read: Dict[int, Any]) -> Dict[str, Any]:
        """Slot i's state: master, exp_avg, exp_avg_sq (flat fp32) and step (each bucket read
        once into `read`)."""
        if b.slot is None:
            return {}
        if b.serial not in read:
            read[b.serial] = self.read_all(b)
        parts, steps = read[b.serial]
        state = {key: b.slice(flat, i) for key, flat in parts.items()}
        state["step"] = steps[i]
        return state

    def write(self, b: Bucket, parts: Dict[str, List[Optional[torch.Tensor]]],
              steps: List[int]) -> None:
        """Sets b's state: per parameter its master (None: the weights as they are), exp_avg and
        exp_avg_sq, and its step. A master in `out` is the weights: a given one is set there."""
        masters = parts["master"]
        master = None
        if b.master == _abi.ADAM_MASTER_IN_STATE:
            master = torch.cat([b.weight(i).float() if v is None else v
                                for i, v in enumerate(masters)] or [torch.zeros(0)])
        elif any(v is not None for v in masters):
            b.set_weights(torch.cat([b.weight(i).float() if v is None else v
                                     for i, v in enumerate(masters)]))
        flat = {k: torch.cat(parts[k]) if parts[k] else torch.zeros(0)
                for k in ("exp_avg", "exp_avg_sq")}
        self.adam.set_state(b.slot, _ptr(master), _ptr(flat["exp_avg"]),
                            _ptr(flat["exp_avg_sq"]), b.numel)
        self.adam.set_tensor_steps(b.slot, steps)

    def initialize(self, buckets: List[Bucket], moved: Dict[int, Dict[str, Any]]) -> None:
        """Gives the owned `buckets`, just made, their state: resumed state sets the model's
        weights; otherwise the model's weights become the master weights, with the state of any
        parameter in `moved` (id -> master, exp_avg, exp_avg_sq, step) carried over."""
        for b in buckets:
            if self.adam.initialized(b.slot):  # resumed
                b.set_weights(self.read(b, _abi.ADAM_PARAMS))
                continue
            parts = {"master": [], "exp_avg": [], "exp_avg_sq": []}
            steps = []
            for i, p in enumerate(b.params):
                state = moved.get(id(p), {})
                for key in parts:
                    value = state.get(key)
                    if value is None and key == "master":
                        parts[key].append(None)  # the weights as they are
                        continue
                    if value is None:
                        value = torch.zeros_like(p, dtype=torch.float32)
                    parts[key].append(value.reshape(-1).to("cpu", torch.float32))
                steps.append(int(state.get("step", 0)))
            self.write(b, parts, steps)

    # ---- torch's format ----

    def export(self, param_groups: List[Dict[str, Any]], owned: List[Bucket]) -> Dict[str, Any]:
        """torch.optim.AdamW's state_dict of the `owned` buckets' parameters (see
        OffloadedAdamW.state_dict)."""
        index = {}
        groups = []
        for g in param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append(packed)
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for b in owned:
            if not b.active:
                continue
            steps = self.tensor_steps(b)
            if not any(steps[i] for i in range(len(steps)) if b.live[i]):
                continue
            m, v = self.read(b, _abi.ADAM_M), self.read(b, _abi.ADAM_V)
            master = self.read(b, _abi.ADAM_PARAMS) if b.dtype != torch.float32 else None
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

    def load(self, state_dict: Dict[str, Any], param_groups: List[Dict[str, Any]],
             owned: List[Bucket]) -> None:
        """Loads torch.optim.AdamW's (or OffloadedAdamW's) state_dict into the `owned` buckets
        and the groups' hyperparameters (see OffloadedAdamW.load_state_dict)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, param_groups)):
            raise InvalidArgument("loaded state dict's parameter groups do not match the "
                                  "optimizer's")
        if any(s.get("amsgrad") for s in saved_groups):
            raise InvalidArgument("loaded state dict is of an amsgrad AdamW, which this optimizer "
                                  "does not implement")
        by_param = {}
        for s, g in zip(saved_groups, param_groups):
            for saved_id, p in zip(s["params"], g["params"]):
                by_param[id(p)] = state_dict["state"].get(saved_id, {})
        for entry in by_param.values():
            for key in ("exp_avg", "exp_avg_sq", "master"):
                value = entry.get(key)
                if value is not None and not torch.is_tensor(value):
                    raise InvalidArgument(f"state {key} is not a tensor")
        # Everything is read and checked before anything is written.
        plans = [self._plan_load(b, by_param) for b in owned if b.active]
        dormant = [(b, self.tensor_steps(b)) for b in owned if not b.active]
        everything = [int(torch.as_tensor(e["step"]).item()) for e in by_param.values()
                      if "step" in e]
        # steps_taken: the most any parameter has taken (each keeps its own count, set after).
        self.adam.set_steps(max(everything, default=0))
        for b, parts, steps in plans:
            self.write(b, parts, steps)
        for b, steps in dormant:
            self.adam.set_tensor_steps(b.slot, steps)
        for s, g in zip(saved_groups, param_groups):
            for key, value in s.items():
                if key != "params":
                    g[key] = tuple(value) if key == "betas" else value

    def _plan_load(self, b: Bucket, by_param: Dict[int, Dict[str, Any]]):
        """(b, parts, steps) to write for b: each live parameter's loaded state, checked; the
        slots of parameters no longer in the groups keep theirs."""
        current, current_steps = None, None
        if not all(b.live):
            current, current_steps = self.read_all(b)
        parts = {"master": [], "exp_avg": [], "exp_avg_sq": []}
        steps = []
        for i, p in enumerate(b.params):
            if not b.live[i]:
                for key in parts:
                    parts[key].append(None if key == "master" and b.master ==
                                      _abi.ADAM_MASTER_IN_OUT else b.slice(current[key], i))
                steps.append(current_steps[i])
                continue
            entry = by_param[id(p)]
            for key in parts:
                value = entry.get(key)
                if value is None and key == "master":
                    parts[key].append(None)  # the weights as they are
                    continue
                if value is None:
                    value = torch.zeros_like(p, dtype=torch.float32)
                if value.shape != p.shape:
                    raise InvalidArgument(f"state {key} of shape {tuple(value.shape)} for a "
                                          f"parameter of shape {tuple(p.shape)}")
                parts[key].append(value.reshape(-1).to("cpu", torch.float32))
            steps.append(int(torch.as_tensor(entry.get("step", 0)).item()))
            if steps[-1] < 0:
                raise InvalidArgument(f"state step {steps[-1]} < 0")
        return b, parts, steps

    # ---- a step, as the library runs it ----

    def begin(self, owned: List[Bucket], grad_scale: float) -> None:
        """Begins the library's step, each group with its parameter group's hyperparameters (in
        the lanes placed when the last step finished: backward has held gradients by now)."""
        for b in owned:
            self.adam.set_group_hyper(b.slot, hyper(b.group))
        self.adam.begin_step(grad_scale)

    def launch(self, b: Bucket) -> None:
        """Queues bucket b's step (its gradients, flags, taken weights and `out`)."""
        code = STEPPED_DTYPES[b.dtype]
        self.lanes.launched(b)
        grad = b.buffers.hold_kept_grads()
        self.adam.step_tensors(b.slot, _ptr(grad), code, _ptr(b.buffers.out), code, b.flags,
                               len(b.sizes), _ptr(b.weights))

    def wait(self, b: Bucket, timeout_s: float) -> bool:
        """Whether the library is done with bucket b's gradients and `out` (launched this step),
        waiting at most timeout_s; raises when b is not in the step (it ended)."""
        try:
            self.adam.wait_group(b.slot, timeout_s)
            return True
        except TierdError as e:
            if e.code == _abi.Status.DEADLINE_EXCEEDED:
                return False
            raise

    def finish(self, owned: List[Bucket]) -> Dict[str, float]:
        """Waits for the step's groups; the library's figures of it. Then places the `owned`
        buckets for the next step, before its backward holds their gradients."""
        stats = _abi.AdamStepStats()
        self.adam.finish_step(stats)
        figures = {"step": float(stats.step), "wall_s": stats.wall_ns / 1e9,
                   "compute_s": stats.compute_ns / 1e9, "state_wait_s": stats.state_wait_ns / 1e9,
                   "write_wait_s": stats.write_wait_ns / 1e9,
                   "state_bytes": float(stats.state_bytes)}
        if self.lanes.enabled:
            lanes = self.adam.lanes()
            self.lanes.measured = lanes.share
            figures.update({"device_share": self.lanes.share,
                            "host_params": float(lanes.host_params),
                            "host_busy_s": lanes.host_ns / 1e9,
                            "device_params": float(lanes.device_params),
                            "device_busy_s": lanes.device_ns / 1e9,
                            "device_kept_bytes": float(lanes.device_kept_bytes)})
        self.lanes.place(self.adam, owned)
        return figures

    def give_up(self, speculative: bool) -> None:
        """Ends a step without applying more: abandoned (the state as before it) when it was
        speculative, else finished with what it applied."""
        if speculative:
            self.adam.abandon_step()
        else:
            self.adam.finish_step()

    def close(self) -> None:
        self.adam.close()


def open_on_every_rank(owned: List[Bucket], comm, **options) -> OptimizerState:
    """Opens this rank's share of the state in its own node's daemon (OptimizerState.open with
    `options`) and gives the `owned` buckets their state. Sharded over ranks (`comm`), one rank
    that cannot (no daemon on its node) must not leave the others waiting in a collective: every
    rank learns it and raises, naming it; and every share must be resumed or none, at one step."""
    state, failed = None, None
    try:
        if comm is not None:
            options["rank_suffix"] = f".rank{comm.rank}of{comm.world}"
        state = OptimizerState.open(owned, **options)
        state.initialize(owned, {})
    except Exception as e:  # noqa: BLE001 (re-raised here or by all_succeeded)
        failed = e
    try:
        if comm is None:
            if failed is not None:
                raise failed
        else:
            comm.all_succeeded("open the optimizer's state", failed)
            comm.agree_on_state(state.resumed, state.adam.steps_taken)
    except BaseException:
        if state is not None:
            state.close()
        raise
    return state
