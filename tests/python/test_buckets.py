"""OffloadedAdamW's buckets (tierd/torch/_buckets.py) on their own: plain buckets, no daemon.

plan() cuts each group's parameters into buckets in backward's order, at a change of dtype and
at the bucket size; a bucket's flags say which weights a step steps (a gradient present) and
which it takes (changed by the caller; written but equal is not changed); publish() puts the new
weights of the stepped ones into the model; a dormant bucket holds its weights by weak
reference; write_back() keeps the weights only taken; each step starts with a record of its own.
"""
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from tierd import _abi  # noqa: E402
from tierd.torch._buckets import Bucket, plan, write_back  # noqa: E402

STEP, TAKE = _abi.ADAM_TENSOR_STEP, _abi.ADAM_TENSOR_TAKE_WEIGHTS


def params(*shapes, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, dtype=dtype)) for s in shapes]


def bucket(ps):
    b = Bucket(0, "g0.0", {"lr": 1e-3}, ps)
    b.mirror()  # the weights as the optimizer leaves them
    return b


def test_plan_cuts_groups_in_backwards_order_at_dtype_and_size():
    a = params((4,), (4,), (4,), (4,))
    h = params((4,), dtype=torch.bfloat16)
    z = params((2,))
    g0, g1 = {"i": 0}, {"i": 1}
    keyed = [(0, g0, a[3]), (0, g0, a[0]), (0, g0, a[1]), (0, g0, h[0]), (0, g0, a[2]),
             (1, g1, z[0])]
    buckets = plan(keyed, bucket_params=8, first_serial=5)
    # The last group first; within a group the last parameters first (their gradients come
    # first); a change of dtype, and a bucket full at 8 elements, start a new one.
    assert [b.name for b in buckets] == ["g1.5", "g0.6", "g0.7", "g0.8", "g0.9"]
    assert [[id(p) for p in b.params] for b in buckets] == [
        [id(z[0])], [id(a[2])], [id(h[0])], [id(a[1]), id(a[0])], [id(a[3])]]
    assert buckets[0].group is g1 and all(b.group is g0 for b in buckets[1:])
    assert buckets[3].offsets == [0, 4] and buckets[3].numel == 8
    assert buckets[2].dtype == torch.bfloat16


def test_flags_step_what_has_a_gradient_and_take_what_the_caller_changed():
    ps = params((3,), (2,), (2,))
    b = bucket(ps)
    b.this_step.has = [True, False, False]
    with torch.no_grad():
        ps[1].add_(1.0)   # changed
        ps[2].mul_(1.0)   # written, but equal: not changed
    assert b.flag()
    assert list(b.flags) == [STEP, TAKE, 0]
    assert torch.equal(b.slice(b.weights, 1), ps[1].detach())  # the weight it takes
    assert not b.changed(2) and not b.touched(2)  # remembered as equal


def test_nothing_to_do_without_gradients_or_changes():
    b = bucket(params((3,)))
    assert not b.flag() and list(b.flags) == [0]


def test_publish_puts_the_stepped_weights_into_the_model():
    ps = params((2,), (2,))
    b = bucket(ps)
    before = ps[1].detach().clone()
    b.buffers.out.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with torch.no_grad():  # as in step()
        b.publish([STEP, 0])
    assert ps[0].tolist() == [1.0, 2.0] and torch.equal(ps[1].detach(), before)
    assert not b.touched(0)  # as the optimizer left it


def test_write_back_keeps_the_weights_only_taken():
    ps = params((2,), (2,))
    b = bucket(ps)
    b.this_step.has = [True, False]
    with torch.no_grad():
        ps[1].fill_(9.0)
    assert b.flag()
    b.buffers.out[:2] = torch.tensor([5.0, 6.0])  # the kernel's new weights of the stepped one
    with torch.no_grad():  # as in step()
        assert write_back([b], [b], None) is None  # on the CPU: no event to wait for
    assert ps[0].tolist() == [5.0, 6.0] and ps[1].tolist() == [9.0, 9.0]
    assert b.buffers.out.tolist() == [5.0, 6.0, 9.0, 9.0]  # as the optimizer leaves them


def test_a_dormant_bucket_holds_its_weights_by_weak_reference():
    ps = params((2,), (2,))
    b = bucket(ps)
    b.go_dormant()
    assert b.params is None and not b.active and b.param(1) is ps[1]
    b.wake()
    assert b.params == ps and b.active
    b.go_dormant()
    del ps
    gc.collect()
    assert b.param(0) is None and b.param(1) is None


def test_a_master_in_out_the_model_did_not_take_goes_back_to_the_weights():
    ps = params((2,))
    b = bucket(ps)
    assert b.out_can_be_master(device_tier=False)
    assert not b.out_can_be_master(device_tier=True)
    b.master = _abi.ADAM_MASTER_IN_OUT
    b.prime_out()
    b.buffers.out.fill_(7.0)  # a launched step's new weights, then the step abandoned
    b.unbind()
    assert torch.equal(b.buffers.out, ps[0].detach())


def test_each_step_starts_with_a_record_of_its_own():
    b = bucket(params((2,), (2,)))
    first = b.this_step
    first.got[0] = first.launched = first.complete = True
    first.expected, first.arrived = 2, 1
    b.reset_step()
    now = b.this_step
    assert now is not first
    assert (now.got, now.has, now.expected, now.arrived, now.complete, now.event,
            now.launched) == ([False, False], [False, False], 0, 0, False, None, False)
