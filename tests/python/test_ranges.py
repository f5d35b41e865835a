"""The seam's StreamRange (tierd/torch/_ranges.py) on its own, against a real daemon.

A range reads and sets the current weights (what gathered() shows); a step's new weights go into
the next version, which commit() makes whole and current; a step ended without a commit leaves
the weights as they were; what a step puts aside is held again as it was, and gradients freed
are not; a version no range reads or writes any more is never written down; `info` names what the range never sets; a closed stream's ranges refuse every verb.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import tierd.torch  # noqa: E402
from tierd.client import Access, Tier  # noqa: E402
from tierd.torch._ranges import stream_ranges  # noqa: E402

from test_c_abi import daemon  # noqa: E402,F401 (a fixture)

BLOCKS = 4


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(BLOCKS))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture
def ranges(daemon):  # noqa: F811
    """(model, stream, ranges): one range per block; the first block's chunks at home in the
    host tier, the others' on NVMe."""
    model = Model()
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    stream = tierd.torch.stream_parameters(model, device=torch.device("cpu"),
                                           device_budget_bytes=1 << 20, socket_dir=daemon,
                                           host_budget_bytes=4 * block + 4096)
    keyed, plain = stream_ranges([(0, p) for p in model.parameters()])
    assert plain == []
    yield model, stream, [rng for _, rng in keyed]
    stream.close()


def weights(model, stream):
    with stream.gathered():
        return [p.detach().clone() for p in model.parameters()]


def by_block(model, rngs):
    """The ranges in the blocks' order (stream_ranges gives backward's)."""
    first = {id(rng.info.params[0]): rng for rng in rngs}
    return [first[id(next(b.parameters()))] for b in model.blocks]


def test_info_names_the_parameters_and_whether_the_unit_pages(ranges):
    model, stream, rngs = ranges
    rngs = by_block(model, rngs)
    for b, rng in zip(model.blocks, rngs):
        assert [id(p) for p in rng.info.params] == [id(p) for p in b.parameters()]
        assert rng.info.nodes is None
    assert [rng.info.pages for rng in rngs] == [False, True, True, True]


def test_current_reads_and_sets_the_weights_the_model_has(ranges):
    model, stream, rngs = ranges
    before = weights(model, stream)
    rng = by_block(model, rngs)[2]
    w, b = rng.info.params
    with rng.current() as now:
        flat = now.clone()
    with stream.gathered():
        assert torch.equal(flat, torch.cat([w.detach().reshape(-1), b.detach().reshape(-1)]))
    with rng.current(Access.WRITE) as now:
        now.copy_(flat + 1)
    after = weights(model, stream)
    for i, (x, y) in enumerate(zip(before, after)):
        changed = i in (4, 5)  # block 2's weight and bias
        assert torch.equal(y, x + 1) if changed else torch.equal(y, x)


@pytest.mark.parametrize("block", [0, 3])  # at home in the host tier, on NVMe
def test_commit_makes_the_next_version_whole_and_current(ranges, block):
    model, stream, rngs = ranges
    rng = by_block(model, rngs)[block]
    w, b = rng.info.params
    with stream.gathered():
        old_w, old_b = w.detach().clone(), b.detach().clone()
    model(torch.ones(1, 8))  # the units in the window with the current version
    out = rng.next()
    out[:w.numel()].copy_(torch.full((w.numel(),), 7.0))  # the weight stepped, the bias not
    out[w.numel():w.numel() + b.numel()].fill_(-1.0)       # (what the kernel left is not used)
    rng.commit([True, False])
    rng.end_step()
    y = model(torch.ones(1, 8))  # sees the new version, not a stale copy in the window
    with stream.gathered():
        assert torch.equal(w, torch.full_like(old_w, 7.0))
        assert torch.equal(b, old_b)
        with torch.no_grad():
            x = torch.ones(1, 8)
            for blk in model.blocks:
                x = blk(x)
    assert torch.equal(y.detach(), x)


def test_a_step_ended_without_a_commit_leaves_the_weights(ranges):
    model, stream, rngs = ranges
    before = weights(model, stream)
    for rng in rngs:
        rng.next().fill_(123.0)
        rng.grads().fill_(1.0)
        rng.end_step()
    assert all(torch.equal(x, y) for x, y in zip(before, weights(model, stream)))
    for rng in rngs:  # nothing was kept: a next step's holds start afresh
        assert rng.grads(kept_only=True) is None


def test_what_is_put_aside_is_held_again_as_it_was(ranges):
    model, stream, rngs = ranges
    rng = by_block(model, rngs)[3]
    n = sum(p.numel() for p in rng.info.params)
    rng.next()[:n].copy_(torch.arange(n, dtype=torch.float32))
    rng.grads()[:n].copy_(torch.arange(n, dtype=torch.float32) * 2)
    rng.put_aside(free=False)
    unit = stream._units[3]  # its versions written down and dropped from the host tier
    stream._client.evict([unit.chunk_id(0), unit.chunk_id(1)], Tier.NVME).wait()
    assert torch.equal(rng.grads(kept_only=True)[:n], torch.arange(n, dtype=torch.float32) * 2)
    assert torch.equal(rng.next()[:n], torch.arange(n, dtype=torch.float32))
    rng.put_aside(free=False, weights=False)  # the gradients alone: the next version stays held
    rng.next()[0] = -5.0
    rng.commit([True, True])
    rng.end_step()
    expect = torch.arange(n, dtype=torch.float32)
    expect[0] = -5.0
    with rng.current() as now:
        assert torch.equal(now, expect)


def step(rng, value):
    """One step of the range: every parameter's new weights `value`, made current."""
    n = sum(p.numel() for p in rng.info.params)
    rng.next()[:n].fill_(value)
    rng.commit([True] * len(rng.info.params))
    rng.end_step()


def test_a_units_old_version_once_flipped_from_is_never_written_down(ranges):
    model, stream, rngs = ranges
    rng = by_block(model, rngs)[3]  # at home on NVMe
    unit = stream._units[3]
    step(rng, 1.0)  # version 1 current
    step(rng, 2.0)  # version 0 current: version 1 holds weights nobody reads again
    client = stream._client
    client.evict([unit.chunk_id(0)], Tier.NVME).wait()  # the current weights, written down
    written = client.path_bytes("host_to_nvme")
    client.evict([unit.chunk_id(1)], Tier.NVME).wait()
    assert client.path_bytes("host_to_nvme") == written  # dropped unwritten
    with rng.current() as now:
        assert torch.equal(now, torch.full_like(now, 2.0))


def test_a_version_another_range_is_writing_into_is_not_discarded(ranges):
    model, stream, rngs = ranges
    # Two ranges per unit: the weights (group 0) and the biases (group 1).
    keyed, _ = stream_ranges([(int(p.dim() == 1), p) for p in model.parameters()])
    unit = stream._units[3]
    mine = {id(p) for p in unit.params}
    w, b = [rng for _, rng in keyed if id(rng.info.params[0]) in mine]
    step(w, 1.0)  # the weights' current version is 1, the biases' still 0
    # The biases' next version (1) is written and put aside; the weights then flip away from
    # 1, which another range is still writing into.
    b.next()[:b.info.params[0].numel()].fill_(5.0)
    b.put_aside(free=False)
    step(w, 2.0)
    stream._client.evict([unit.chunk_id(0), unit.chunk_id(1)], Tier.NVME).wait()
    b.commit([True])
    b.end_step()
    with b.current() as now:
        assert torch.equal(now, torch.full_like(now, 5.0))
    with w.current() as now:
        assert torch.equal(now, torch.full_like(now, 2.0))


def test_gradients_put_aside_and_freed_are_not_held_again(ranges):
    model, stream, rngs = ranges
    rng = by_block(model, rngs)[1]
    rng.grads().fill_(3.0)
    rng.put_aside(free=True)
    assert rng.grads(kept_only=True) is None
    rng.end_step()


def test_a_closed_streams_ranges_refuse_every_verb(ranges):
    model, stream, rngs = ranges
    stream.close()
    rng = rngs[0]
    for verb in (lambda: rng.current().__enter__(), rng.next, rng.grads,
                 lambda: rng.commit([True, True])):
        with pytest.raises(RuntimeError, match="closed"):
            verb()
