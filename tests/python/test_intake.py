"""OffloadedAdamW's gradient intake (tierd/torch/_intake.py) on its own: real backward passes over
plain buckets, no daemon.

A bucket is handed over (the `ready` event, on the hand-over thread) once every gradient it
awaits has come, in backward's order, its gradients copied into its buffer; with gradient
accumulation, at the last pass, summed; a pass more than accumulation_steps is refused before a
gradient could be lost; frozen buckets are complete at once; what backward did not give is taken
at step() (take_rest), a parameter without a gradient left unstepped; an error on the hand-over
thread is raised by settle(), once.
"""
import os
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from tierd import _abi  # noqa: E402
from tierd.torch._intake import GradientIntake  # noqa: E402
from tierd.torch._layout import BucketLayout  # noqa: E402

BLOCKS = 3


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(BLOCKS))
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.sum()


class Intake:
    """An intake over one bucket per block (bucket_params: one block's), as the optimizer's
    Stepper drives it: expect() at the step's first gradient; `handed` the buckets handed over,
    in order, and the thread each was handed over on."""

    def __init__(self, model, accumulation_steps=1, ready=None):
        self.groups = [{"params": list(model.parameters())}]
        block = sum(p.numel() for p in model.blocks[0].parameters())
        self.layout = BucketLayout(lambda: self.groups, block, None)
        for b in self.layout.buckets:  # the weights as the optimizer leaves them
            b.mirror()
        self.handed = []
        self.begun = False
        self.intake = GradientIntake(self.layout, accumulation_steps, False, self._prepare,
                                     lambda b: None, ready or self._ready)
        self.intake.install(self.groups)

    def _prepare(self):
        if not self.begun:
            self.begun = True
            self.intake.expect()

    def _ready(self, b):
        self.handed.append((b, threading.current_thread().name))

    def bucket_of(self, module):
        return self.layout.where[id(next(module.parameters()))][0]

    def end_step(self):
        for b in self.layout.buckets:
            b.reset_step()
        self.intake.end_step()
        self.begun = False


@pytest.fixture
def model():
    return Model()


def test_a_bucket_is_handed_over_once_its_gradients_are_in_in_backwards_order(model):
    it = Intake(model)
    model(torch.ones(2, 4)).backward()
    it.intake.settle()
    order = [it.bucket_of(m) for m in reversed(model.blocks)]
    assert [b for b, _ in it.handed] == order
    assert all(name.startswith("tierd-hand-over") for _, name in it.handed)
    for m in model.blocks:
        b = it.bucket_of(m)
        assert b.this_step.complete and b.this_step.has == [True] * len(b.sizes)
        for i, p in enumerate(b.params):
            assert torch.equal(b.slice(b.buffers.grad, i), p.grad.reshape(-1))
    assert not it.bucket_of(model.unused).this_step.complete  # no gradient: not handed over
    it.intake.close()


def test_accumulated_passes_are_handed_over_at_the_last_summed(model):
    it = Intake(model, accumulation_steps=2)
    model(torch.ones(2, 4)).backward()
    it.intake.settle()
    assert it.handed == []
    first = {id(p): p.grad.clone() for p in model.parameters() if p.grad is not None}
    model(torch.full((2, 4), 0.5)).backward()
    it.intake.settle()
    assert len(it.handed) == BLOCKS
    for b, _ in it.handed:
        for i, p in enumerate(b.params):
            assert torch.equal(b.slice(b.buffers.grad, i), p.grad.reshape(-1))
            assert not torch.equal(p.grad, first[id(p)])  # both passes, summed
    it.intake.close()


def test_a_pass_more_than_accumulation_steps_is_refused(model):
    it = Intake(model)
    model(torch.ones(2, 4)).backward()
    it.intake.settle()
    with pytest.raises(RuntimeError, match="accumulation_steps is 1"):
        model(torch.ones(2, 4)).backward()
    it.intake.close()


def test_a_bucket_whose_parameters_were_frozen_is_complete_at_once(model):
    it = Intake(model)
    for p in model.blocks[0].parameters():  # frozen after they got their place
        p.requires_grad_(False)
    it.intake.expect()
    assert it.bucket_of(model.blocks[0]).this_step.complete
    assert not it.bucket_of(model.blocks[1]).this_step.complete
    it.intake.close()


def test_what_backward_did_not_give_is_taken_at_step_and_left_unstepped(model):
    it = Intake(model)
    y = model(torch.ones(2, 4)) + model.unused.weight.sum() * 0  # its bias not used
    y.backward()
    it.intake.settle()
    b = it.bucket_of(model.unused)
    assert not b.this_step.complete
    todo = it.intake.take_rest(None)
    assert b in todo and b.this_step.complete
    has = [p is model.unused.weight for p in b.params]  # the bucket's order is backward's
    assert b.this_step.has == has
    assert [b.flags[i] for i in range(2)] == [_abi.ADAM_TENSOR_STEP if h else 0 for h in has]
    it.intake.close()


def test_an_error_on_the_hand_over_thread_is_raised_by_settle_once(model):
    def ready(b):
        raise ValueError(f"no room for {b.name}")
    it = Intake(model, ready=ready)
    with pytest.raises(ValueError, match="no room"):  # backward's end settles
        model(torch.ones(2, 4)).backward()
    it.intake.settle()  # once: nothing is left to raise
    it.intake.close()
