"""What a step holds, given back as the library finishes with it (tierd/torch/_release.py), on
its own: the Launcher over a release whose room the test makes, no daemon.

Complete buckets are launched in the order they completed, as the release has room. Backward's
wait for room (`wait_room`, before a paging bucket's gradients are first held) lasts while
WAITING paging buckets wait for their launch: it ends when one is launched, when a launch failed
(step() raises that error) or when the waiting buckets are forgotten; buckets whose buffers do
not page (this process's own) hold nothing of the daemon's and never make backward wait.
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from tierd.torch import _release  # noqa: E402
from tierd.torch._release import WAITING, Launcher  # noqa: E402


class Buffers:
    def __init__(self, pages):
        self.pages = pages


class Bucket:
    def __init__(self, name, pages=True):
        self.name = name
        self.buffers = Buffers(pages)


class Release:
    """Room for launches when `room` is set."""

    def __init__(self):
        self.room = False

    def has_room(self, b):
        return self.room or not b.buffers.pages


class Run:
    """A Launcher whose hand-over thread is the caller's, launching into `launched`."""

    def __init__(self, fail=False):
        self.release = Release()
        self.launched = []
        self.fail = fail
        self.launcher = Launcher(self.release, self._launch, lambda fn: fn())

    def _launch(self, b):
        if self.fail:
            raise RuntimeError(f"launching {b.name} failed")
        self.launched.append(b.name)

    def wait_room_in_thread(self):
        """Backward's wait, on a thread of its own: the thread, and an event set once it ends."""
        done = threading.Event()

        def wait():
            self.launcher.wait_room()
            done.set()

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        return thread, done


def test_complete_buckets_are_launched_in_order_as_room_is_made():
    run = Run()
    for name in ("b3", "b2", "b1"):
        run.launcher.add(Bucket(name))
    assert run.launched == []
    run.release.room = True
    run.launcher.room_made()
    assert run.launched == ["b3", "b2", "b1"]


def test_backward_waits_while_waiting_buckets_fill_their_room_and_goes_on_at_a_launch():
    run = Run()
    for k in range(WAITING - 1):
        run.launcher.add(Bucket(f"b{k}"))
    _, done = run.wait_room_in_thread()
    assert done.wait(5), "fewer than WAITING buckets waiting: backward does not wait"
    run.launcher.add(Bucket("last"))
    thread, done = run.wait_room_in_thread()
    assert not done.wait(3 * _release._POLL_S)  # WAITING buckets wait for their launch
    run.release.room = True
    run.launcher.room_made()
    assert done.wait(5)
    thread.join(5)
    assert run.launched == [f"b{k}" for k in range(WAITING - 1)] + ["last"]


def test_a_failed_launch_ends_backwards_wait_and_step_raises_it():
    run = Run(fail=True)
    for k in range(WAITING):
        run.launcher.add(Bucket(f"b{k}"))
    _, done = run.wait_room_in_thread()
    assert not done.wait(3 * _release._POLL_S)
    run.release.room = True
    run.launcher.room_made()  # the first launch fails
    assert done.wait(5)
    error = run.launcher.clear()
    assert isinstance(error, RuntimeError) and "launching b0 failed" in str(error)


def test_forgotten_buckets_end_backwards_wait():
    run = Run()
    for k in range(WAITING):
        run.launcher.add(Bucket(f"b{k}"))
    _, done = run.wait_room_in_thread()
    assert not done.wait(3 * _release._POLL_S)
    assert run.launcher.clear() is None  # step(): the rest is launched there
    assert done.wait(5)


def test_buckets_whose_buffers_do_not_page_never_make_backward_wait():
    run = Run()
    run.launcher.add(Bucket("paging"))  # no room: it waits, and those behind it
    for k in range(WAITING + 1):
        run.launcher.add(Bucket(f"host{k}", pages=False))
    start = time.monotonic()
    run.launcher.wait_room()  # one paging bucket waits: less than WAITING
    assert time.monotonic() - start < 1
    assert run.launched == []
