"""A stream's units and their chunks (tierd/torch/_units.py) and the optimizer's gradient chunks of
their ranges (tierd/torch/_grad_chunks.py), on their own, against a real daemon.

Units are placed at home on the host while their two versions fit the budget, on NVMe past it; a
unit laid out holds its parameters' weights in version 0 and reads them back as written; a range's
gradient chunk is made at its first hold, keeps what it holds when held again with keep, goes when
freed, and spills to NVMe when the host tier has no room for it.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from tierd.client import Client, Tier, TierdError  # noqa: E402
from tierd._abi import Status  # noqa: E402
from tierd.torch._units import Units, by_dtype, find_units  # noqa: E402

from test_c_abi import daemon  # noqa: E402,F401 (a fixture)


class Model(torch.nn.Module):
    def __init__(self, blocks=4, width=64):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))


@pytest.fixture
def client(daemon):
    with Client(daemon, "test_units") as c:
        yield c


def unit_bytes(width=64):
    """Both versions of one Linear(width, width) unit's chunks, as place() sizes them."""
    units = Units(find_units(Model(blocks=2, width=width), None), None, torch.device("cpu"))
    units.place(None, has_nvme=True, allocate=False)
    return 2 * units[0].chunk_bytes


def test_units_are_at_home_on_the_host_while_the_budget_holds_them_then_on_nvme():
    units = Units(find_units(Model(), None), None, torch.device("cpu"))
    units.place(host_budget_bytes=2 * unit_bytes() + 1, has_nvme=True, allocate=False)
    assert [u.home for u in units] == [Tier.HOST, Tier.HOST, Tier.NVME, Tier.NVME]
    # Without an NVMe tier everything stays on the host, whatever the budget.
    units.place(host_budget_bytes=0, has_nvme=False, allocate=False)
    assert [u.home for u in units] == [Tier.HOST] * 4
    # No budget: no limit.
    units.place(host_budget_bytes=None, has_nvme=True, allocate=False)
    assert [u.home for u in units] == [Tier.HOST] * 4


@pytest.mark.parametrize("budget", [None, 0], ids=["host", "nvme"])
def test_a_unit_laid_out_reads_back_the_weights_written_into_it(client, budget):
    model = Model(blocks=2)
    units = Units(find_units(model, None), client, torch.device("cpu"))
    units.place(budget, has_nvme=True)
    try:
        for u in units:
            values = {id(p): p.detach().reshape(-1).clone() for p in u.params}
            units.lay_out(u, by_dtype(u.own_params()), 0, values)
            got = {id(p): w for p, w in units.weights(u)}
            assert set(got) == set(values)
            for key, w in got.items():
                assert torch.equal(w, values[key])
            # A change written into the current version is read back, and counted as edited.
            p = u.params[0]
            units.write_weights(u, {id(p): torch.full((p.numel(),), 0.5)})
            assert torch.equal(dict((id(q), w) for q, w in units.weights(u))[id(p)],
                               torch.full((p.numel(),), 0.5))
            assert id(p) in u.edited
    finally:
        for u in units:
            units.free(u)


def laid_out(client, budget=None, has_nvme=True):
    model = Model(blocks=2)
    units = Units(find_units(model, None), client, torch.device("cpu"))
    units.place(budget, has_nvme=has_nvme)
    units.free(units[1])  # one unit is enough
    u = units[0]
    units.lay_out(u, by_dtype(u.own_params()), 1,
                  {id(p): p.detach().reshape(-1).clone() for p in u.params})
    return units, u


def test_a_ranges_gradients_are_made_at_their_first_hold_kept_when_asked_and_freed(client):
    units, u = laid_out(client)
    try:
        r = u.ranges[0]
        assert r.grad_chunk is None  # nothing before its first gradient
        grads, held = units.grads.hold(u, r)
        assert r.grad_chunk is not None
        assert grads.numel() == r.numel + r.extra and grads.dtype == r.dtype
        grads.copy_(torch.arange(grads.numel(), dtype=grads.dtype))
        del grads
        held.release()
        again, held = units.grads.hold(u, r, keep=True)
        assert torch.equal(again, torch.arange(again.numel(), dtype=again.dtype))
        del again
        held.release()
        units.grads.free(r)
        assert r.grad_chunk is None
    finally:
        units.free(u)


def fill_host(client):
    """Chunks at home on the host until it has room for none, however small (none has a copy
    below to drop)."""
    filler = []
    for size in (1 << 20, 4096):
        while True:
            try:
                filler.append(client.allocate([size], Tier.HOST))
            except TierdError as e:
                assert e.code == Status.RESOURCE_EXHAUSTED, e
                break
    return filler


def test_a_host_units_gradients_spill_to_nvme_when_the_host_tier_is_full(client):
    units, u = laid_out(client)
    filler = fill_host(client)
    try:
        r = u.ranges[0]
        # Without an NVMe tier the host's refusal is the caller's to see...
        units.grads.has_nvme = False
        with pytest.raises(TierdError) as e:
            units.grads.make(u, r)
        assert e.value.code == Status.RESOURCE_EXHAUSTED
        assert r.grad_chunk is None
        # ...with one, the chunk is made at home there, and held in host memory as any other.
        units.grads.has_nvme = True
        grads, held = units.grads.hold(u, r)
        assert r.grad_chunk is not None
        grads.fill_(1.0)
        del grads
        held.release()
        units.grads.free(r)
        assert r.grad_chunk is None
    finally:
        for chunks in filler:
            chunks.free()
        units.free(u)
