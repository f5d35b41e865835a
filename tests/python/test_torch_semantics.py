"""OffloadedAdamW where training code leaves the straight path, against torch.optim.AdamW doing the
same: frozen parameters (a LoRA-style model), parameters without a gradient in a step (experts
that got no tokens), uneven per-parameter step counts in state_dicts both ways, add_param_group
and params lists edited between steps (a parameter replaced, and brought back), parameters
without elements, and weights changed between steps (a clamp, a load, a swap). What cannot work
is refused with a clear error."""
import os
import sys

import pytest
import torch
from torch import nn

from test_c_abi import daemon  # noqa: F401 (daemon: a fixture)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import tierd.torch  # noqa: E402

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def offloaded(params, daemon, **kwargs):  # noqa: F811
    options = dict(HYPER, socket_dir=daemon, host_budget_bytes=1 << 20, threads=2, home="nvme")
    options.update(kwargs)
    return tierd.torch.OffloadedAdamW(params, **options)


def close_weights(got, want, what=""):
    """The fused kernel and torch's AdamW: one formula in another order, within fp32 rounding."""
    for (name, a), b in zip(want.named_parameters(), got.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{what}{name}: {m}")


def tokens(step, n=16, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randint(0, 64, (n, 8), generator=g)


class LoRA(nn.Module):
    """A frozen base (embedding and projection) with a trainable low-rank update and head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.base = nn.Linear(128, 64)
        self.lora_a = nn.Parameter(torch.randn(4, 128) * 0.05)
        self.lora_b = nn.Parameter(torch.zeros(64, 4))
        self.head = nn.Linear(64, 64)

    def forward(self, x):
        h = self.embed(x).flatten(1)
        return self.head(torch.tanh(self.base(h) + (h @ self.lora_a.t()) @ self.lora_b.t()))


def lora_loss(m, step):
    x = tokens(step)
    return nn.functional.cross_entropy(m(x), x[:, 3])


@pytest.mark.parametrize("overlap", [False, True])
def test_frozen_parameters_in_a_shared_bucket_stay_bit_identical(daemon, overlap):  # noqa: F811
    ref, m = LoRA(), LoRA()
    for model in (ref, m):
        model.embed.requires_grad_(False)
        model.base.requires_grad_(False)
    frozen = {k: v.clone() for k, v in m.state_dict().items() if k.startswith(("embed", "base"))}
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = offloaded(m.parameters(), daemon, overlap_backward=overlap, bucket_params=1 << 20)
    try:
        assert len(opt._layout.buckets) == 1  # frozen and trainable parameters share one bucket
        for step in range(20):
            for model, o in ((ref, ref_opt), (m, opt)):
                o.zero_grad(set_to_none=False)  # frozen parameters' .grad stays None anyway
                lora_loss(model, step).backward()
                o.step()
        exported = opt.state_dict()
    finally:
        opt.close()
    for k, v in frozen.items():
        assert torch.equal(m.state_dict()[k], v), f"{k} changed"
    close_weights(m, ref)
    # torch keeps no state for a parameter never stepped; neither does the export.
    torch_state = ref_opt.state_dict()["state"]
    assert sorted(exported["state"]) == sorted(torch_state) == [0, 1, 5, 6]
    for i in torch_state:
        assert float(exported["state"][i]["step"]) == float(torch_state[i]["step"]) == 20


class MoE(nn.Module):
    """Tokens routed to four experts; the experts a step uses are a function of the step, so some
    get no tokens (and no gradient) in some steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(64, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 64)

    def forward(self, x, step):
        h = self.embed(x)
        used = [e for e in range(4) if (step >> e) & 1 or e == step % 4]
        route = x % len(used)
        out = torch.zeros_like(h)
        for j, e in enumerate(used):
            mask = (route == j).unsqueeze(-1)
            out = out + mask * torch.relu(self.experts[e](h))
        return self.head(out.mean(1))


def moe_step(m, opt, step, set_to_none=True):
    opt.zero_grad(set_to_none=set_to_none)
    x = tokens(step, seed=2)
    loss = nn.functional.cross_entropy(m(x, step), x[:, 0])
    loss.backward()
    opt.step()
    return float(loss)


@pytest.mark.parametrize("overlap,set_to_none", [(False, True), (True, True), (True, False)])
def test_experts_without_tokens_are_left_as_torch_leaves_them(daemon, overlap,  # noqa: F811
                                                              set_to_none):
    ref, m = MoE(), MoE()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = offloaded(m.parameters(), daemon, overlap_backward=overlap, bucket_params=300)
    try:
        losses, ref_losses = [], []
        for step in range(16):
            ref_losses.append(moe_step(ref, ref_opt, step, set_to_none))
            losses.append(moe_step(m, opt, step, set_to_none))
        exported = opt.state_dict()
    finally:
        opt.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    close_weights(m, ref)
    torch_state = ref_opt.state_dict()["state"]
    assert sorted(exported["state"]) == sorted(torch_state)
    steps = {i: float(s["step"]) for i, s in torch_state.items()}
    assert {i: float(s["step"]) for i, s in exported["state"].items()} == steps
    if set_to_none:  # unused experts had no gradient: uneven counts
        assert len(set(steps.values())) > 1, steps
    for i, s in torch_state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(exported["state"][i][key], s[key], rtol=1e-4, atol=1e-7)


def test_uneven_step_counts_load_both_ways_and_training_goes_on(daemon):  # noqa: F811
    # Uninterrupted: torch for 18 steps.
    ref = MoE()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    ref_losses = [moe_step(ref, ref_opt, step) for step in range(18)]
    # torch for 6, tierd for 6 from torch's state_dict, torch again from tierd's.
    m = MoE()
    first = torch.optim.AdamW(m.parameters(), **HYPER)
    losses = [moe_step(m, first, step) for step in range(6)]
    opt = offloaded(m.parameters(), daemon, bucket_params=300)
    try:
        opt.load_state_dict(first.state_dict())
        assert opt.steps_taken == 6
        losses += [moe_step(m, opt, step) for step in range(6, 12)]
        exported = opt.state_dict()
    finally:
        opt.close()
    last = torch.optim.AdamW(m.parameters(), **HYPER)
    last.load_state_dict(exported)
    losses += [moe_step(m, last, step) for step in range(12, 18)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    close_weights(m, ref)


class TwoPart(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lower = nn.Sequential(nn.Embedding(64, 16), nn.Flatten(), nn.Linear(128, 32))
        self.upper = nn.Sequential(nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 64))

    def forward(self, x):
        return self.upper(self.lower(x))


def two_part_step(m, opt, step):
    opt.zero_grad()
    x = tokens(step, seed=4)
    loss = nn.functional.cross_entropy(m(x), x[:, 5])
    loss.backward()
    opt.step()
    return float(loss)


@pytest.mark.parametrize("overlap", [False, True])
def test_add_param_group_unfreezes_as_torch_does(daemon, overlap):  # noqa: F811
    """Progressive unfreezing: the upper part trains first, the lower joins at step 5 with a
    learning rate of its own."""
    ref, m = TwoPart(), TwoPart()
    ref_opt = torch.optim.AdamW(ref.upper.parameters(), **HYPER)
    opt = offloaded(m.upper.parameters(), daemon, overlap_backward=overlap, bucket_params=1000)
    try:
        losses, ref_losses = [], []
        for step in range(12):
            if step == 5:
                ref_opt.add_param_group({"params": list(ref.lower.parameters()), "lr": 3e-3})
                opt.add_param_group({"params": list(m.lower.parameters()), "lr": 3e-3})
            ref_losses.append(two_part_step(ref, ref_opt, step))
            losses.append(two_part_step(m, opt, step))
        exported = opt.state_dict()
    finally:
        opt.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    close_weights(m, ref)
    torch_state = ref_opt.state_dict()["state"]
    assert {i: float(s["step"]) for i, s in exported["state"].items()} == \
        {i: float(s["step"]) for i, s in torch_state.items()}
    assert exported["param_groups"][1]["lr"] == 3e-3


@pytest.mark.parametrize("overlap", [False, True])
def test_frozen_parameters_get_no_state_until_they_train_as_torch_does(daemon, overlap):  # noqa: F811,E501
    """Every parameter given, the lower part frozen: as torch.optim.AdamW, which makes a
    parameter's state at its first step with a gradient, the frozen part has none (it cost its
    full fp32 state before); unfrozen in place at step 5, it gets its state then and trains as
    torch's does."""
    ref, m, upper_only = TwoPart(), TwoPart(), TwoPart()
    for model in (ref, m, upper_only):
        model.lower.requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = offloaded(m.parameters(), daemon, overlap_backward=overlap, bucket_params=1000)
    alone = offloaded(upper_only.upper.parameters(), daemon, bucket_params=1000)
    try:
        assert opt.state_bytes == alone.state_bytes > 0
        losses, ref_losses = [], []
        for step in range(12):
            if step == 5:
                ref.lower.requires_grad_(True)
                m.lower.requires_grad_(True)
            ref_losses.append(two_part_step(ref, ref_opt, step))
            losses.append(two_part_step(m, opt, step))
            if step == 5:
                assert opt.state_bytes > alone.state_bytes
        exported = opt.state_dict()
    finally:
        opt.close()
        alone.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    close_weights(m, ref)
    torch_state = ref_opt.state_dict()["state"]
    assert {i: float(s["step"]) for i, s in exported["state"].items()} == \
        {i: float(s["step"]) for i, s in torch_state.items()}


def test_a_parameter_replaced_in_a_group_and_brought_back(daemon):  # noqa: F811
    """A head replaced by a new one (its state fresh, the old one's kept), then the old one put
    back: torch steps it on from the state it had."""
    ref, m = TwoPart(), TwoPart()
    torch.manual_seed(9)
    new_heads = [nn.Linear(32, 64), nn.Linear(32, 64)]
    new_heads[1].load_state_dict(new_heads[0].state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = offloaded(m.parameters(), daemon, bucket_params=1000)
    old = {}
    try:
        losses, ref_losses = [], []
        for step in range(12):
            for model, o, head in ((ref, ref_opt, new_heads[0]), (m, opt, new_heads[1])):
                params = o.param_groups[0]["params"]
                if step == 4:  # the head replaced
                    old[id(o)] = model.upper[2]
                    gone = [id(p) for p in old[id(o)].parameters()]
                    params[:] = [p for p in params if id(p) not in gone]
                    params.extend(head.parameters())
                    model.upper[2] = head
                if step == 8:  # and put back
                    gone = [id(p) for p in head.parameters()]
                    params[:] = [p for p in params if id(p) not in gone]
                    params.extend(old[id(o)].parameters())
                    model.upper[2] = old[id(o)]
            ref_losses.append(two_part_step(ref, ref_opt, step))
            losses.append(two_part_step(m, opt, step))
    finally:
        opt.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    close_weights(m, ref)
    close_weights(new_heads[1], new_heads[0], "replacement ")


def test_parameters_without_elements_are_accepted(daemon):  # noqa: F811
    empty, ref_empty = nn.Parameter(torch.zeros(0)), nn.Parameter(torch.zeros(0))
    weight, ref_weight = nn.Parameter(torch.ones(5)), nn.Parameter(torch.ones(5))
    ref_opt = torch.optim.AdamW([{"params": [ref_weight]}, {"params": [ref_empty]}], **HYPER)
    opt = offloaded([{"params": [weight]}, {"params": [empty]}], daemon)
    try:
        for o, w, e in ((ref_opt, ref_weight, ref_empty), (opt, weight, empty)):
            for _ in range(3):
                o.zero_grad()
                ((w * 2).sum() + e.sum()).backward()
                o.step()
        exported = opt.state_dict()
    finally:
        opt.close()
    torch.testing.assert_close(weight.detach(), ref_weight.detach(), rtol=1e-5, atol=0)
    assert float(exported["state"][1]["step"]) == float(ref_opt.state_dict()["state"][1]["step"])
    assert exported["state"][1]["exp_avg"].shape == (0,)


def test_eps_zero_is_accepted_and_stepped_as_torch_does(daemon):  # noqa: F811
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(64))
    ref_weight = nn.Parameter(weight.detach().clone())
    ref_opt = torch.optim.AdamW([ref_weight], **dict(HYPER, eps=0.0))
    opt = offloaded([weight], daemon, eps=0.0)
    try:
        for o, w in ((ref_opt, ref_weight), (opt, weight)):
            for step in range(3):
                o.zero_grad()
                (w * torch.linspace(1, 2, 64) * (step + 1)).sum().backward()
                o.step()
    finally:
        opt.close()
    torch.testing.assert_close(weight.detach(), ref_weight.detach(), rtol=1e-5, atol=1e-7)


def test_weights_changed_between_steps_are_stepped_from(daemon):  # noqa: F811
    """A clamp after each step (a weight constraint), weights loaded into the model after the
    optimizer was made, and a tensor swapped in by `.data =`: torch steps from the weights as they
    are, and so does OffloadedAdamW (fp32: exactly those weights)."""
    ref, m = TwoPart(), TwoPart()
    torch.manual_seed(5)
    pretrained = {k: torch.randn_like(v) * 0.1 if v.dtype.is_floating_point else v
                  for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = offloaded(m.parameters(), daemon, bucket_params=1000)
    try:
        ref.load_state_dict(pretrained)  # after the optimizer was made
        m.load_state_dict(pretrained)
        losses, ref_losses = [], []
        for step in range(10):
            ref_losses.append(two_part_step(ref, ref_opt, step))
            losses.append(two_part_step(m, opt, step))
            for model in (ref, m):
                with torch.no_grad():
                    for p in model.upper.parameters():
                        p.clamp_(-0.08, 0.08)
                    if step == 6:  # an averaged copy swapped in
                        w = model.lower[2].weight
                        w.data = (w.data * 0.5).clone()
        exported = opt.state_dict()
    finally:
        opt.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    close_weights(m, ref)
    for p in m.upper.parameters():
        assert p.abs().max() <= 0.08
    assert set(exported["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_bf16_weights_changed_are_taken_as_they_are_and_untouched_ones_keep_the_master(
        daemon):  # noqa: F811
    torch.manual_seed(6)
    w = nn.Parameter(torch.randn(4096).bfloat16())
    v = nn.Parameter(torch.randn(4096).bfloat16())
    opt = offloaded([w, v], daemon, lr=1e-3, weight_decay=0.0)
    try:
        for step in range(4):
            opt.zero_grad()
            ((w.float() ** 2).sum() + (v.float() ** 2).sum()).backward()
            opt.step()
            with torch.no_grad():
                w.clamp_(-0.5 + 0.1 * step, 0.5 - 0.1 * step)  # changed: the master is these
                v.mul_(1.0)  # written, but unchanged: the master keeps its precision
        state = opt.state_dict()["state"]
        master_w, master_v = state[0]["master"], state[1]["master"]
        # The master of w is its bf16 values (documented: a bf16 weight changed by the caller
        # carries no more precision than bf16); v's fp32 master is more precise than v.
        assert torch.equal(master_w, w.detach().float())
        assert not torch.equal(master_v, master_v.bfloat16().float())
        torch.testing.assert_close(master_v.bfloat16(), v.detach(), rtol=0, atol=0)
        # The next step steps from the clamped weights.
        opt.zero_grad()
        ((w.float() ** 2).sum() + (v.float() ** 2).sum()).backward()
        opt.step()
        assert w.detach().abs().max() <= 0.2 + 2e-3
    finally:
        opt.close()


def test_changes_while_buckets_are_stepped_during_backward_are_refused(daemon):  # noqa: F811
    m = TwoPart()
    opt = offloaded(m.parameters(), daemon, overlap_backward=True, bucket_params=1000)
    try:
        two_part_step(m, opt, 0)
        extra = nn.Parameter(torch.zeros(3))
        nn.functional.cross_entropy(m(tokens(1)), tokens(1)[:, 0]).backward()
        opt.add_param_group({"params": [extra]})  # after backward stepped the buckets
        with pytest.raises(RuntimeError, match="parameter groups changed between backward"):
            opt.step()
        assert opt.steps_taken == 2  # the buckets stepped during backward were finished
        # Between steps it is fine.
        two_part_step(m, opt, 2)
        nn.functional.cross_entropy(m(tokens(3)), tokens(3)[:, 0]).backward()
        with torch.no_grad():
            m.upper[2].weight.mul_(0.5)
        halved = m.upper[2].weight.detach().clone()
        with pytest.raises(RuntimeError, match="weights changed between backward and step"):
            opt.step()
        assert torch.equal(m.upper[2].weight, halved)  # the caller's change stands
        two_part_step(m, opt, 4)
    finally:
        opt.close()


def test_refusals_name_the_parameter(daemon):  # noqa: F811
    p = nn.Parameter(torch.zeros(4))
    opt = offloaded([p], daemon)
    try:
        opt.param_groups[0]["params"].append(p)  # torch's add_param_group refuses this too
        with pytest.raises(ValueError, match="more than one parameter group"):
            opt.step()
        opt.param_groups[0]["params"].pop()
        with pytest.raises(TypeError, match="float64"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, dtype=torch.float64))]})
        assert len(opt.param_groups) == 1  # nothing was added
        p.grad = torch.ones(4)
        opt.step()
        assert opt.steps_taken == 1
    finally:
        opt.close()


def test_groups_added_later_resume_when_added_again(daemon):  # noqa: F811
    """A persistent run that adds a group at step 4: a new process making the optimizer with the
    first group resumes it, and adding the second group resumes that one too."""
    ref = TwoPart()
    ref_opt = torch.optim.AdamW(ref.upper.parameters(), **HYPER)
    ref_losses = []
    for step in range(10):
        if step == 4:
            ref_opt.add_param_group({"params": list(ref.lower.parameters())})
        ref_losses.append(two_part_step(ref, ref_opt, step))

    m = TwoPart()
    opt = offloaded(m.upper.parameters(), daemon, name="pytest/unfreeze", reset=True)
    losses = []
    try:
        for step in range(7):
            if step == 4:
                opt.add_param_group({"params": list(m.lower.parameters())})
            losses.append(two_part_step(m, opt, step))
    finally:
        opt.close()
    torch.manual_seed(99)
    m = TwoPart()  # a new process: other weights until the state sets them
    for p in m.parameters():
        p.data.add_(torch.randn_like(p))
    opt = offloaded(m.upper.parameters(), daemon, name="pytest/unfreeze", resume=True)
    try:
        assert opt.resumed and opt.steps_taken == 7
        opt.add_param_group({"params": list(m.lower.parameters())})  # as the first run did
        losses += [two_part_step(m, opt, step) for step in range(7, 10)]
    finally:
        opt.close()
        offloaded(m.upper.parameters(), daemon, name="pytest/unfreeze", reset=True).close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    close_weights(m, ref)


def trained_as_torch(losses, ref_losses, m, ref):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    close_weights(m, ref)


def _backward_that_raises(m, step):
    """A backward that raises partway (an out-of-memory error in the lower part, say), after the
    upper part's gradients were taken."""
    def oom(grad):
        raise RuntimeError("out of memory")
    h = m.lower.register_forward_hook(lambda mod, a, out: out.register_hook(oom) and None)
    try:
        x = tokens(step, seed=4)
        with pytest.raises(RuntimeError, match="out of memory"):
            nn.functional.cross_entropy(m(x), x[:, 5]).backward()
    finally:
        h.remove()


def test_a_batch_whose_backward_raised_is_dropped_by_zero_grad_as_torch_drops_it(daemon):  # noqa: F811,E501
    """The out-of-memory loop: a batch whose backward raises is dropped (zero_grad) and training
    goes on. The upper part was stepped during that backward (overlap_backward); the step being
    speculative (max_grad_norm), it is taken back, and the training is torch's."""
    ref, m = TwoPart(), TwoPart()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = offloaded(m.parameters(), daemon, overlap_backward=True, max_grad_norm=1e6,
                    bucket_params=2200)  # never clips; the upper and lower parts apart
    ref_losses, losses = [], []
    try:
        for step in range(6):
            for model, o, out in ((ref, ref_opt, ref_losses), (m, opt, losses)):
                if step == 2:
                    _backward_that_raises(model, 100)
                    if o is opt:
                        opt._stepper.settle()
                        assert opt._stepper._stepped(), "nothing was stepped during it"
                out.append(two_part_step(model, o, step))  # its zero_grad() drops the batch
        assert opt.steps_taken == 6
    finally:
        opt.close()
    trained_as_torch(losses, ref_losses, m, ref)


def disturbed_beside_torch(daemon, disturb):  # noqa: F811
    """One step of TwoPart beside torch's, then step 1 as `disturb(model, optimizer, is_torch)`
    takes it, then three more: the training is torch's. Overlapped, not speculative, the upper
    and lower parts in buckets of their own."""
    ref, m = TwoPart(), TwoPart()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = offloaded(m.parameters(), daemon, overlap_backward=True, bucket_params=2200)
    try:
        ref_losses = [two_part_step(ref, ref_opt, 0)]
        losses = [two_part_step(m, opt, 0)]
        disturb(ref, ref_opt, True)
        disturb(m, opt, False)
        assert opt.steps_taken == 2
        close_weights(m, ref, "step 1: ")
        for step in range(2, 5):
            ref_losses.append(two_part_step(ref, ref_opt, step))
            losses.append(two_part_step(m, opt, step))
    finally:
        opt.close()
    trained_as_torch(losses, ref_losses, m, ref)


def test_a_step_begun_in_a_backward_that_raised_is_kept_by_zero_grad_and_applied_by_step(daemon):  # noqa: F811,E501
    """Without speculation, what backward stepped cannot be taken back: zero_grad() says so and
    changes nothing, and step() applies the step with the gradients that backward gave, as
    torch's step() does after it (the lower part, which got none, is not stepped)."""
    def disturb(model, o, is_torch):
        _backward_that_raises(model, 1)
        if not is_torch:
            with pytest.raises(RuntimeError, match="cannot be taken back"):
                o.zero_grad()
        o.step()
    disturbed_beside_torch(daemon, disturb)


def test_zero_grad_between_backward_passes_drops_a_micro_batch_as_torch_does(daemon):  # noqa: F811
    """Gradient accumulation (two backward passes a step) where a first micro-batch is dropped by
    zero_grad() before the two that count: the step sums those two, as torch's does. Dropping by
    zeroing (set_to_none=False) cannot be done once the gradients left the parameters: refused."""
    ref, m = TwoPart(), TwoPart()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = offloaded(m.parameters(), daemon, overlap_backward=True, accumulation_steps=2,
                    bucket_params=2200)

    def loss(model, k):
        x = tokens(k, seed=5)
        return nn.functional.cross_entropy(model(x), x[:, 5])
    try:
        for model, o in ((ref, ref_opt), (m, opt)):
            for step in range(3):
                o.zero_grad()
                loss(model, 10 * step).backward()
                if o is opt and step == 0:
                    with pytest.raises(RuntimeError, match="set_to_none=False"):
                        o.zero_grad(set_to_none=False)
                o.zero_grad()  # the first micro-batch dropped
                loss(model, 10 * step + 1).backward()
                loss(model, 10 * step + 2).backward()
                o.step()
        assert opt.steps_taken == 3
    finally:
        opt.close()
    close_weights(m, ref)


def test_a_step_refused_after_backward_stepped_its_buckets_is_finished_whole(daemon):  # noqa: F811,E501
    """A step refused after overlap_backward stepped its buckets (the groups changed in between)
    is finished, not half applied: the weights move with the state, as torch's step() moves
    them, and training goes on as torch's."""
    def disturb(model, o, is_torch):
        o.zero_grad()
        x = tokens(1, seed=4)
        nn.functional.cross_entropy(model(x), x[:, 5]).backward()
        o.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
        if is_torch:
            o.step()
            return
        with pytest.raises(RuntimeError, match="parameter groups changed"):
            o.step()
    disturbed_beside_torch(daemon, disturb)
