"""The device window (tierd/torch/_window.py) on its own, on the CPU, against a real daemon.

A unit used is in the window with its weights once used; the next units the trace names are
fetched ahead; a unit a pass still uses is never evicted for room (the overflow is counted), and
one that no pass uses is when the window needs its place; a fetch that fails leaves the unit out
of the window and the bytes it counted given back; after a pass that raised, nothing is used or
kept.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from tierd.client import Client, TierdError  # noqa: E402
from tierd.torch._figures import StreamFigures  # noqa: E402
from tierd.torch._trace import Trace  # noqa: E402
from tierd.torch._units import Units, by_dtype, find_units  # noqa: E402
from tierd.torch._window import SlotState, Window  # noqa: E402

from test_c_abi import daemon  # noqa: E402,F401 (a fixture)

BLOCKS = 6


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(BLOCKS))


@pytest.fixture
def stream(daemon):
    """(model, units, window, stats): every unit laid out with its weights, the window's
    storage empty, one unit fetched ahead."""
    model = Model()
    client = Client(daemon, "test_window")
    units = Units(find_units(model, None), client, torch.device("cpu"))
    units.place(None, has_nvme=True)
    weights = {}
    for u in units:
        values = {id(p): p.detach().reshape(-1).clone() for p in u.params}
        weights.update(values)
        units.lay_out(u, by_dtype(u.own_params()), 0, values)
    stats = StreamFigures()
    window = Window(units, Trace(units, stats), torch.device("cpu"), prefetch=1, figures=stats)
    yield model, units, window, stats, weights
    window.close()
    for u in units:
        units.free(u)
    client.close()


def resident(units, window):
    return [u.index for u in units if window.slot(u).in_window]


def test_a_unit_used_holds_its_weights_and_the_next_is_fetched_ahead(stream):
    model, units, window, stats, weights = stream
    u = units[0]
    window.use(u, traced=True, in_backward=False)
    assert window.slot(u).state is SlotState.IN and window.in_use(u)
    for p in u.params:
        assert torch.equal(p.detach().reshape(-1), weights[id(p)])
    assert resident(units, window) == [0, 1]  # the next one, ahead
    assert stats.on_demand == 1 and stats.fetches == 2
    assert window.live == units[0].device_bytes + units[1].device_bytes
    window.unuse(u, in_backward=False)
    assert not window.any_in_use()


def test_a_unit_in_use_is_never_evicted_for_room_the_window_counts_the_overflow(stream):
    model, units, window, stats, _ = stream
    for u in units[:window.size]:
        window.use(u, traced=True, in_backward=False)
    assert window.in_window() == window.size and stats.over_window == 0
    for u in units[window.size:]:  # a forward holding every unit (as nested calls would)
        window.use(u, traced=True, in_backward=False)
    assert all(window.slot(u).in_window for u in units)  # in use: none was evicted for room
    assert stats.over_window > 0  # said so instead
    for u in units:
        window.unuse(u, in_backward=False)
    window.evict_unused()
    assert resident(units, window) == [] and window.live == 0


def test_a_unit_no_pass_uses_gives_its_place_to_the_one_needed(stream):
    model, units, window, stats, _ = stream
    for u in units:  # one at a time: each released before the next
        window.use(u, traced=True, in_backward=False)
        window.unuse(u, in_backward=False)
        assert window.in_window() <= window.size
    assert stats.over_window == 0


def test_a_fetch_that_fails_leaves_the_unit_out_and_its_bytes_given_back(stream):
    model, units, window, stats, _ = stream
    window.units.client.close()  # every request fails from now on
    u = units[0]
    u.views = {}  # as an NVMe unit: its chunks are acquired for the copy
    with pytest.raises(TierdError):
        window.fetch(u)
    assert window.slot(u).state is SlotState.OUT
    assert window.live == 0 and window.slot(u).reading is None


def test_after_a_pass_that_raised_nothing_is_used_or_kept(stream):
    model, units, window, stats, _ = stream
    window.use(units[0], traced=True, in_backward=False)
    window.use(units[1], traced=True, in_backward=False)
    window.evict_all()
    assert not window.any_in_use()
    assert resident(units, window) == [] and window.live == 0
