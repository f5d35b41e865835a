"""A base this session holds in the daemon, as a shared base (_shared_base.py) and the ranks'
weights (_ranks.py) both hold one: made or opened, waiting while another session loads it, and
let go once, whether or not the daemon is still there.
"""
import time
from typing import Callable, Optional, Sequence

from .._abi import Status
from ..client import Client, OpenedBase, Tier, TierdError


class HeldBase:
    def __init__(self, client: Client, name: str):
        self.client = client
        self.name = name
        self.held = False

    def open(self, wait_s: float, poll_s: float,
             make: Optional[Callable[[], Optional[OpenedBase]]] = None) -> OpenedBase:
        """Opens the base, waiting (every `poll_s`, `wait_s` at most) while another session
        loads it. Where there is none, `make()` makes it (None: another session made it first,
        and it is opened); without `make`, TierdError NOT_FOUND."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                opened = self.client.open_base(self.name)
            except TierdError as e:
                if e.code == Status.NOT_FOUND and make is not None:
                    opened = make()
                    if opened is None:
                        continue
                elif e.code == Status.UNAVAILABLE and time.monotonic() < deadline:
                    time.sleep(poll_s)
                    continue
                else:
                    raise
            self.held = True
            return opened

    def make(self, sizes: Sequence[int], homes: Sequence[Tier], descriptor: bytes,
             group: Optional[int] = None, job_writable: bool = False) -> OpenedBase:
        """Makes the base, or opens the one there (Client.open_base with its contents; its
        errors): held from now."""
        opened = self.client.open_base(self.name, sizes, homes, descriptor, group, job_writable)
        self.held = True
        return opened

    def release(self) -> None:
        """Lets the base go (the daemon frees it with its last holder, unless it is pinned);
        nothing when not held, or when the daemon is gone (and the hold with it)."""
        if not self.held or self.client.closed:
            return
        self.held = False
        try:
            self.client.release_base(self.name)
        except TierdError:
            pass
