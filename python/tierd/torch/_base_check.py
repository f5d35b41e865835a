"""An opener's full check of a shared base, in the background (docs/streaming.md, "One copy per
node").

A job that opens a shared base checks every byte its own checkpoint gives the units against the
SHA-256 the base's maker recorded (_shared_base.py). For a 13 B model that is some 26 GB read and
hashed, half a minute, so it runs in a thread of its own while the job goes on starting (peft's
adapters, the optimizer, the data) and its first forward and backward run. It is waited for
wherever the base's weights would first leave a mark the job keeps or shows: before an optimizer
step (any optimizer in the process: torch's global step pre-hook), before a forward without
gradients reaches a unit (evaluation, generate), before gathered(), save_pretrained() and a
close that gives the weights back. A check that failed raises there, and at each such point
after, until the stream is closed: a job never steps, nor hands out an output, from weights other
than its checkpoint's.
"""
import hashlib
import threading
import time
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._errors import InvalidArgument

# What the base's units are given, in the maker's order: a tensor, or (numel, dtype, reader) for
# a checkpoint's tensor that reader(out) reads into `out`.
Value = Union[torch.Tensor, Tuple[int, torch.dtype, Callable[[torch.Tensor], None]]]


def contents(values: List[Value], stop: Optional[threading.Event] = None) -> Optional[str]:
    """The SHA-256 of the values' bytes, one tensor in memory at a time; None when `stop` is set
    before the end."""
    h = hashlib.sha256()
    for v in values:
        if stop is not None and stop.is_set():
            return None
        if isinstance(v, tuple):
            numel, dtype, read = v
            v = torch.empty(numel, dtype=dtype)
            read(v)
        h.update(v.contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


class BaseCheck:
    """The hash of a checkpoint's values against the maker's, in a thread; wait() gives its
    verdict, raising ValueError while it is a refusal. `finished` is called in the thread when it
    is done with the values (their files can be closed)."""

    def __init__(self, name: str, expected: str, values: List[Value],
                 finished: Callable[[], None]):
        self.name = name
        self.waited_s = 0.0  # what the job waited for the verdict
        self._expected = expected
        self._values = values
        self._finished = finished
        self._stop = threading.Event()
        self._refusal: Optional[str] = None
        self._passed = False
        self._handles: list = []
        self._thread = threading.Thread(target=self._run, name=f"tierd base check {name}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            got = contents(self._values, self._stop)
            if got is not None and got != self._expected:
                self._refusal = (f"shared base {self.name!r} holds other weights than this "
                                 "checkpoint's frozen parameters (another checkpoint or "
                                 "fine-tune under the same name; found by the check of every "
                                 "byte, which runs while the job starts): give the base another "
                                 "name")
        except Exception as e:  # noqa: BLE001 (the verdict is the job's to raise)
            self._refusal = (f"shared base {self.name!r}: this checkpoint could not be read "
                             f"whole to check it against the base ({e}); nothing was stepped "
                             "from the base")
        finally:
            self._values = []
            self._finished()

    def gate(self, units: List[nn.Module]) -> None:
        """Waits for the verdict before any optimizer step and before a forward without
        gradients reaches one of the units (ahead of the stream's own hooks: a unit refused is
        not fetched); the gates go once the check has passed. The units, not the model: peft's
        wrapper calls the model's forward() past its hooks."""
        self._handles = [register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: self.wait())]
        for m in units:
            self._handles.append(m.register_forward_pre_hook(
                lambda module, args: None if torch.is_grad_enabled() else self.wait(),
                prepend=True))

    def wait(self) -> None:
        """Returns once the check has passed; raises ValueError when it failed."""
        if self._passed:
            return
        start = time.monotonic()
        self._thread.join()
        self.waited_s += time.monotonic() - start
        if self._refusal is not None:
            raise InvalidArgument(self._refusal)
        self._passed = True
        self._remove_gates()

    def close(self) -> None:
        """Stops the check (at the next tensor) and removes the gates."""
        self._stop.set()
        self._thread.join()
        self._remove_gates()

    def _remove_gates(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
