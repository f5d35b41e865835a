"""OffloadedAdamW's two lanes: which buckets the client library steps on the device.

With `device_share` set, a share of this rank's buckets is stepped by the device's kernels: each
step their state comes up into the daemon's device tier and goes home again (or stays there,
within device_budget_bytes), and a streamed bucket's gradients are held there as backward makes
them, while the CPU steps the rest (docs/optimizer/library.md, "Stepping on the device"). The
buckets given to the device are those whose gradients come last in backward (the last step's
launch order; before any step, the order the buckets were laid out in, which is backward's): the
CPU lane's tail after backward is then shortest.
"auto" takes the share that balances the lanes' rates as the library measured them over the last
steps, 0.5 until both lanes have stepped. Placement changes between steps only: when the optimizer
is made, when the setting changes, and as each step finishes, for the next (before its backward
holds a gradient).
"""
from typing import List, Union

from .._errors import FailedPrecondition, InvalidArgument
from .. import _abi
from ._buckets import Bucket

Setting = Union[None, float, str]


def check(setting: Setting) -> None:
    if setting is None or setting == "auto":
        return
    if isinstance(setting, bool) or not isinstance(setting, (int, float)) or \
            not 0.0 <= setting <= 1.0:
        raise InvalidArgument(f"device_share must be None, 'auto' or a number in [0, 1], not "
                              f"{setting!r}")


def check_budget(device_budget_bytes: int, name) -> None:
    """device_budget_bytes: the device lane's scratch state kept in the device tier between
    steps (the library's OffloadedAdamOptions::device_budget_bytes)."""
    if isinstance(device_budget_bytes, bool) or not isinstance(device_budget_bytes, int) or \
            device_budget_bytes < 0:
        raise InvalidArgument(f"device_budget_bytes must be an int >= 0, not "
                              f"{device_budget_bytes!r}")
    if device_budget_bytes > 0 and name is not None:
        raise InvalidArgument("device_budget_bytes keeps scratch state on the device between "
                              f"steps; state named {name!r} is persistent and goes home after "
                              "every step")


class DeviceLanes:
    def __init__(self, setting: Setting, device_grads: bool = True):
        check(setting)
        self.setting = setting
        # The device's buckets hold their gradients in the device tier (_buffers.py): not when
        # sharded over ranks, whose gradients are reduced where the process group reads them.
        self.device_grads = device_grads
        self.share = 0.0  # the share of the parameters placed on the device, as placed
        self._placed = False  # some bucket may be on the device
        self.measured = -1.0  # the library's balanced share, as last measured (-1: not yet)
        self._order: List[int] = []  # bucket serials in the order the last step launched them

    @property
    def enabled(self) -> bool:
        return self.setting is not None

    def change(self, setting: Setting, adam, owned: List[Bucket], device_tier: bool) -> None:
        """Places the buckets for a new setting at once (between steps); where that is refused,
        the setting and the placement stay as they were."""
        if setting is not None and not device_tier:
            raise FailedPrecondition("device_share needs the daemon's device tier, and this "
                                     "daemon serves none")
        before = self.setting
        self.setting = setting
        try:
            self.place(adam, owned)
        except BaseException:
            self.setting = before
            self.place(adam, owned)
            raise

    def launched(self, b: Bucket) -> None:
        self._order.append(b.serial)

    def target(self) -> float:
        """The share to place: the setting, or the balanced one measured (0.5 before)."""
        if self.setting == "auto":
            return self.measured if self.measured >= 0 else 0.5
        return float(self.setting)

    def choose(self, owned: List[Bucket], target: float) -> List[Bucket]:
        """The buckets to step on the device: the last to arrive, as many as bring the share of
        parameters nearest the target."""
        # A bucket whose master weights are its `out` is stepped on the host (OptimizerState).
        active = [b for b in owned if b.active and b.master != _abi.ADAM_MASTER_IN_OUT]
        rank = {serial: i for i, serial in enumerate(self._order)}
        # Arrival order: the last step's; buckets it did not launch first, in the layout's order
        # (backward's: _buckets.plan).
        arrival = sorted(active, key=lambda b: (b.serial in rank, rank.get(b.serial, b.serial)))
        total = sum(b.numel for b in active)
        chosen, placed = [], 0
        for b in reversed(arrival):
            if total == 0 or abs(placed + b.numel - target * total) > abs(placed - target * total):
                break
            chosen.append(b)
            placed += b.numel
        self.share = placed / total if total else 0.0
        return chosen

    def place(self, adam, owned: List[Bucket]) -> None:
        """Places this rank's buckets for the step about to begin (between the library's steps);
        turned off, every bucket goes back to the CPU once."""
        if not self.enabled and not self._placed:
            return
        on_device = set()
        if self.enabled:
            on_device = {b.serial for b in self.choose(owned, self.target())}
        else:
            self.share = 0.0
        for b in owned:
            if b.slot is not None:
                adam.set_group_place(b.slot, b.serial in on_device)
            b.buffers.grads_on_device = self.device_grads and b.serial in on_device
        self._placed = self.enabled
        self._order = []
