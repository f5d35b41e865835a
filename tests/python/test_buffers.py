"""A bucket's buffers (tierd/torch/_buffers.py): the same verbs over this process's tensors and
over a streamed range's chunks, against a real daemon.

Host buffers are always held: putting them aside or ending a step keeps their views and what they
hold. A range's buffers view its chunks only while held: put aside, the views go and the
contents stay (held again as they were, the gradients only if kept); at a step's end everything
goes, and nothing put aside is held again.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from tierd.torch._buffers import HostBuffers, RangeBuffers  # noqa: E402

from test_c_abi import daemon  # noqa: E402,F401 (a fixture)
from test_ranges import by_block, ranges  # noqa: E402,F401 (a fixture)


def test_host_buffers_are_always_held_and_keep_what_they_hold():
    buf = HostBuffers(6, 2, torch.float32, pin=False)
    assert buf.grad.numel() == 6 and buf.grad_ext.numel() == 8 and not buf.pages
    buf.hold_grads()
    buf.hold_next()
    buf.grad.fill_(1.0)
    buf.out.fill_(2.0)
    grad, out = buf.grad, buf.out
    buf.put_aside(free=True)
    buf.end_step()
    assert buf.hold_kept_grads() is grad and buf.out is out
    assert grad.eq(1.0).all() and out.eq(2.0).all()


def test_range_buffers_view_the_chunks_only_while_held(ranges):  # noqa: F811
    model, stream, rngs = ranges
    rng = by_block(model, rngs)[3]
    buf = RangeBuffers(rng)
    n = sum(p.numel() for p in rng.info.params)
    assert buf.pages and buf.grad is None and buf.out is None
    assert buf.hold_kept_grads() is None  # nothing was put aside
    buf.hold_grads()
    buf.hold_next()
    assert buf.grad.numel() == n and buf.grad_ext.numel() > n  # the extras after the values
    buf.grad.fill_(3.0)
    buf.out.fill_(4.0)
    buf.put_aside(free=False)
    assert buf.grad is None and buf.out is None
    assert buf.hold_kept_grads().eq(3.0).all()
    buf.hold_next()
    assert buf.out.eq(4.0).all()
    buf.put_aside(free=True, weights=False)  # the gradients go for good; the weights stay held
    assert buf.grad is None and buf.out is not None
    assert buf.hold_kept_grads() is None
    buf.end_step()
    assert buf.grad is None and buf.out is None
    assert buf.hold_kept_grads() is None


def test_a_gradient_taken_into_a_range_leaves_the_device(ranges):  # noqa: F811
    model, stream, rngs = ranges
    rng = by_block(model, rngs)[0]
    w = rng.info.params[0]
    w.grad = torch.ones_like(w)
    before = stream.stats["d2h_bytes"]
    RangeBuffers(rng).gradient_taken(0)
    assert w.grad is None  # dropped on the device, counted as sent
    assert stream.stats["d2h_bytes"] == before + w.numel() * w.element_size()
