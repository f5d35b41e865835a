"""What a step holds, given back as the library finishes with it.

A streamed unit at home on NVMe holds two things in the daemon's host memory while a step runs:
its gradient chunk and the version its new weights are written into. Held to the step's end,
every stepped unit's would be in host memory at once (twice the model's weights in the model's
dtype), which is what a model larger than the host tier cannot have. Instead, once the library
says it is done with a bucket (tierd_adam_wait_group), a thread of this room lets both go: the
new weights stay in their chunk for the step's end to publish (the daemon may write them down
meanwhile), and the gradients are freed, or kept unheld when the step may be taken again
(speculation: the norm is not known yet).

Between its gradients' arrival and its launch a bucket holds nothing (its gradients wait
unheld, and may be written down), and at most IN_FLIGHT paging buckets are launched and not yet
released: the library queues work with the addresses it is given, so what is queued is held.
The optimizer launches the buckets waiting as releases make room (`released`), on its hand-over
thread, which therefore never waits for room itself.

Backward waits instead: before a paging bucket's first gradient is taken, while WAITING buckets
already wait for their launch (`Launcher.wait_room`). Where the optimizer is slower than the
backward (its state streams from NVMe), gradients would otherwise pile up unheld, and those the
host tier has no room for would be written down and read back at their launch: bytes the step
need not move, on the link it waits for.

The releasing thread only releases: it never acquires, so it cannot wait for room that only its
own releases would make.
"""
import collections
import queue
import threading
from typing import Callable, Deque, Optional

from ._buckets import Bucket

_WAIT_S = 1.0  # how long one wait for the library lasts before the thread looks up again
IN_FLIGHT = 2  # paging buckets launched and not released: one stepped, one read ahead
WAITING = 2  # paging buckets complete and not launched, before backward waits for room
_POLL_S = 0.1  # backward's wait for room looks up this often (an error ends it)


class EarlyRelease:
    """Releases launched buckets whose buffers page (_buffers.py) as the library is done with
    them; drain() waits for every one launched so far."""

    def __init__(self, wait: Callable[[Bucket, float], bool], released: Callable[[], None]):
        self._wait = wait  # (bucket, timeout) -> done; False: not within the timeout
        self._released = released  # after each release (room to launch another): must not block
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._lock = threading.Condition()
        self._pending = 0
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def launched(self, b: Bucket, free_grads: bool) -> None:
        """b was given to the library this step; `free_grads`: nothing reads its gradients
        again this step."""
        if not b.buffers.pages:
            return
        with self._lock:
            if self._closed:
                return
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierd-release",
                                                daemon=True)
                self._thread.start()
        self._queue.put((b, free_grads))

    def has_room(self, b: Bucket) -> bool:
        """Whether b may be launched now without waiting (room_to_launch)."""
        with self._lock:
            return not b.buffers.pages or self._pending < IN_FLIGHT

    def room_to_launch(self, b: Bucket) -> None:
        """Before b is launched: waits while IN_FLIGHT paging buckets are launched and not yet
        released."""
        if b.buffers.pages:
            with self._lock:
                self._lock.wait_for(lambda: self._pending < IN_FLIGHT)

    def drain(self) -> None:
        """Returns when every bucket launched so far is released (or was found not to be done:
        the step's end releases it)."""
        with self._lock:
            self._lock.wait_for(lambda: self._pending == 0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            b, free_grads = item
            try:
                while not self._closed:
                    if self._wait(b, _WAIT_S):
                        b.buffers.put_aside(free_grads)
                        break
            except Exception:  # noqa: BLE001 (not done, or the step failed: its end releases b)
                pass
            finally:
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()
            self._released()


class Launcher:
    """Complete buckets, launched in the order they completed while EarlyRelease has room for
    them; never waiting for room (the hand-over thread calls it, and so, through `submit`, does
    a release that made room)."""

    def __init__(self, release: EarlyRelease, launch: Callable[[Bucket], None],
                 submit: Callable[[Callable[[], None]], None]):
        self._release = release
        self._launch = launch  # gives one bucket to the library
        self._submit = submit  # runs a function on the hand-over thread
        self._waiting: Deque[Bucket] = collections.deque()
        self._lock = threading.Condition()
        self._error: Optional[BaseException] = None

    def add(self, b: Bucket) -> None:
        with self._lock:
            self._waiting.append(b)
        self.launch_ready()

    def launch_ready(self) -> None:
        try:
            with self._lock:
                while self._waiting and self._release.has_room(self._waiting[0]):
                    self._launch(self._waiting.popleft())
                    self._lock.notify_all()
        except BaseException as e:  # noqa: B036 (taken by take_error())
            with self._lock:
                self._error = self._error or e
                self._lock.notify_all()

    def wait_room(self) -> None:
        """On autograd's thread, before a paging bucket's gradients are first held: waits while
        WAITING paging buckets wait for their launch. Returns at once after a launch failed
        (step() raises it) or once the waiting buckets are forgotten (clear())."""
        with self._lock:
            while (sum(b.buffers.pages for b in self._waiting) >= WAITING and
                   self._error is None):
                self._lock.wait(_POLL_S)

    def room_made(self) -> None:
        """A release made room: the buckets waiting are launched on the hand-over thread."""
        if self._waiting:
            self._submit(self.launch_ready)

    def clear(self) -> Optional[BaseException]:
        """Forgets the buckets waiting (step() launches them as the rest of the step); returns
        the first error of a launch, if any."""
        with self._lock:
            self._waiting.clear()
            error, self._error = self._error, None
            self._lock.notify_all()
        return error
