"""The trace (tierd/torch/_trace.py) on its own: which units a stream expects next.

Before the first trace a forward expects the units after the one it used, then backward's in
reverse; the first whole iteration becomes the trace, and later ones follow it; a unit used out of
turn is a miss that moves the place, one the rest of the trace does not name leaves it (the rest
of the iteration runs on demand); a forward without gradients expects the forward's units after
the one it used; an iteration that raised is not recorded. (Declaring the trace to the daemon is
streaming's: test_streaming.py checks the planner's schedule and its version bits.)
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from tierd.torch._figures import StreamFigures  # noqa: E402
from tierd.torch._trace import Trace  # noqa: E402
from tierd.torch._units import Units, find_units  # noqa: E402

BLOCKS = 4
ITERATION = [0, 1, 2, 3, 3, 2, 1, 0]  # forward, then backward (the last block first)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(BLOCKS))


@pytest.fixture
def trace():
    units = Units(find_units(Model(), None), client=None, device=torch.device("cpu"))
    stats = StreamFigures()
    return Trace(units, stats), units, stats


def upcoming(t, in_backward=False):
    return [u.index for u in t.upcoming(in_backward)]


def run(t, units, order):
    for index in order:
        t.follow(units[index])


def test_before_the_first_trace_forward_then_backward_is_expected(trace):
    t, units, _ = trace
    t.follow(units[0])
    assert upcoming(t) == [1, 2, 3, 3, 2, 1, 0]
    run(t, units, [1, 2, 3, 3])
    assert upcoming(t, in_backward=True) == [2, 1, 0]


def test_the_first_iteration_becomes_the_trace_and_later_ones_follow_it(trace):
    t, units, stats = trace
    run(t, units, ITERATION)
    t.end_iteration()
    assert t.order == ITERATION and stats.iterations == 1
    t.follow(units[0])
    assert upcoming(t) == ITERATION[1:]
    run(t, units, ITERATION[1:5])
    assert upcoming(t, in_backward=True) == [2, 1, 0]
    assert stats.trace_misses == 0


def test_a_unit_out_of_turn_is_a_miss_that_moves_the_place(trace):
    t, units, stats = trace
    run(t, units, ITERATION)
    t.end_iteration()
    run(t, units, [0, 2])  # block 1 skipped (an early exit, a layer drop)
    assert stats.trace_misses == 1
    assert upcoming(t) == [3, 3, 2, 1, 0]


def test_a_unit_the_rest_of_the_trace_does_not_name_leaves_it(trace):
    t, units, stats = trace
    run(t, units, ITERATION)
    t.end_iteration()
    run(t, units, ITERATION)  # the iteration's end: block 0 is the trace's last
    t.follow(units[3])        # used again before the iteration ends
    assert stats.trace_misses == 1
    assert upcoming(t) == []  # on demand until the next iteration
    t.end_iteration()
    t.follow(units[0])
    assert upcoming(t) == ITERATION[1:]  # the next iteration follows the trace again


def test_a_forward_without_gradients_expects_the_forwards_units(trace):
    t, units, stats = trace
    t.pass_by(units[1])  # before any trace: the units' order
    assert upcoming(t) == [2, 3]
    run(t, units, ITERATION)
    t.end_iteration()
    t.pass_by(units[2])  # the trace's forward, cut at its first repeat
    assert upcoming(t) == [3]
    assert stats.trace_misses == 0  # an evaluation is not recorded, nor a miss


def test_an_iteration_that_raised_is_not_recorded(trace):
    t, units, stats = trace
    run(t, units, [0, 1])
    t.abandon_iteration()
    run(t, units, ITERATION)
    t.end_iteration()
    assert t.order == ITERATION
    assert stats.iterations == 1
