"""The out-of-core optimizer of the client library (`tierd_adam_*`, client/include/tierd/client.h)
as one Python handle: every call of the C ABI's optimizer, its errors raised as TierdError.
OffloadedAdamW (tierd/torch/_state.py and up) is written on this and nothing below it."""
import ctypes
from typing import Any, List, Optional, Sequence

from . import _abi
from ._abi import check, library


def _ptr(address: Optional[int]) -> ctypes.c_void_p:
    return ctypes.c_void_p(address)


def _groups(groups: Sequence[Any]):
    """The C description of groups, each with .name, .numel, .sizes and .master (and what keeps
    it alive)."""
    keep = []
    array = (_abi.AdamGroup * max(len(groups), 1))()
    for j, g in enumerate(groups):
        sizes = (ctypes.c_uint64 * max(len(g.sizes), 1))(*g.sizes)
        name = g.name.encode()
        keep += [sizes, name]
        array[j] = _abi.AdamGroup(name, g.numel, len(g.sizes), sizes, g.master)
    return array, keep


class Adam:
    """An open optimizer state: its groups (by index, "slot"), each of tensors with their own
    step counts. Closed by close() (scratch state is freed; persistent state stays)."""

    def __init__(self, groups: Sequence[Any], options: _abi.AdamOptions):
        self._handle = ctypes.c_void_p()
        array, keep = _groups(groups)
        check(library().tierd_adam_create_groups(len(groups), array, ctypes.byref(options),
                                                   ctypes.byref(self._handle)))
        del keep

    @staticmethod
    def options() -> _abi.AdamOptions:
        """The library's defaults, to fill in."""
        options = _abi.AdamOptions()
        library().tierd_adam_options_init(ctypes.byref(options))
        return options

    @property
    def open(self) -> bool:
        return bool(self._handle)

    @property
    def resumed(self) -> bool:
        return bool(library().tierd_adam_resumed(self._handle))

    def initialized(self, slot: int) -> bool:
        """Whether the group has state already (resumed), not yet set."""
        return bool(library().tierd_adam_initialized(self._handle, slot))

    @property
    def steps_taken(self) -> int:
        return int(library().tierd_adam_steps_taken(self._handle))

    @property
    def state_bytes(self) -> int:
        return int(library().tierd_adam_state_bytes(self._handle))

    # ---- groups ----

    def add_groups(self, groups: Sequence[Any]) -> None:
        array, keep = _groups(groups)
        check(library().tierd_adam_add_groups(self._handle, len(groups), array))
        del keep

    def remove_groups(self, slots: List[int]) -> None:
        array = (ctypes.c_size_t * max(len(slots), 1))(*slots)
        check(library().tierd_adam_remove_groups(self._handle, len(slots), array))

    def set_group_hyper(self, slot: int, hyper: _abi.AdamHyper) -> None:
        check(library().tierd_adam_set_group_hyper(self._handle, slot, ctypes.byref(hyper)))

    # ---- state ----

    def get_state(self, slot: int, part: int, out: int, n: int) -> None:
        """Copies part (ADAM_PARAMS, ADAM_M, ADAM_V) of the group, n fp32 values, to address out."""
        check(library().tierd_adam_get_state(self._handle, slot, part, _ptr(out), n))

    def set_state(self, slot: int, master: Optional[int], m: int, v: int, n: int) -> None:
        """Sets the group's master weights (None for a group whose master is its out), m and v."""
        check(library().tierd_adam_set_state(self._handle, slot, _ptr(master), _ptr(m),
                                               _ptr(v), n))

    def tensor_steps(self, slot: int, n: int) -> List[int]:
        steps = (ctypes.c_int64 * max(n, 1))()
        check(library().tierd_adam_get_tensor_steps(self._handle, slot, steps, n))
        return list(steps)[:n]

    def set_tensor_steps(self, slot: int, steps: List[int]) -> None:
        counts = (ctypes.c_int64 * max(len(steps), 1))(*steps)
        check(library().tierd_adam_set_tensor_steps(self._handle, slot, counts, len(steps)))

    def set_steps(self, steps: int) -> None:
        check(library().tierd_adam_set_steps(self._handle, steps))

    # ---- a step ----

    def begin_step(self, grad_scale: float) -> None:
        check(library().tierd_adam_begin_step(self._handle, grad_scale))

    def step_tensors(self, slot: int, grad: Optional[int], grad_dtype: int, out: Optional[int],
                     out_dtype: int, flags, n: int, weights: Optional[int]) -> None:
        """Queues the group's step (addresses must stay valid until finish_step)."""
        check(library().tierd_adam_step_tensors(self._handle, slot, _ptr(grad), grad_dtype,
                                                  _ptr(out), out_dtype, flags, n,
                                                  _ptr(weights)))

    def finish_step(self, stats: Optional[_abi.AdamStepStats] = None) -> None:
        check(library().tierd_adam_finish_step(
            self._handle, ctypes.byref(stats) if stats is not None else None))

    def wait_group(self, slot: int, timeout_s: float) -> None:
        """Returns once the slot's queued step no longer reads its gradients nor writes its
        `out`; TierdError DEADLINE_EXCEEDED after timeout_s. Any thread."""
        check(library().tierd_adam_wait_group(self._handle, slot, int(timeout_s * 1000)))

    def set_group_place(self, slot: int, on_device: bool) -> None:
        """Where the slot's group is stepped from the next step on (between steps)."""
        place = _abi.ADAM_ON_DEVICE if on_device else _abi.ADAM_ON_HOST
        check(library().tierd_adam_set_group_place(self._handle, slot, place))

    def lanes(self) -> _abi.AdamLanes:
        """The last step's lanes: parameters each stepped, its busy time, the balanced share."""
        lanes = _abi.AdamLanes()
        check(library().tierd_adam_lanes_get(self._handle, ctypes.byref(lanes)))
        return lanes

    def abandon_step(self) -> None:
        check(library().tierd_adam_abandon_step(self._handle))

    def close(self) -> None:
        if self._handle:
            library().tierd_adam_destroy(self._handle)
            self._handle = ctypes.c_void_p()
