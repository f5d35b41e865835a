"""tierd.torch.offload_activations against a real daemon: saved tensors go into tierd chunks (host
and NVMe) and come back bit for bit, so gradients equal those of the run without offload."""
import contextlib
import gc
import os
import sys

import pytest
import torch

from test_c_abi import daemon  # noqa: F401 (fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import tierd  # noqa: E402
import tierd.torch  # noqa: E402
from train_gpt import GPT  # noqa: E402


def gradients(model, batches, offload=None):
    """Loss and gradients of each batch, with the forward inside `offload` when given."""
    out = []
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        with offload if offload is not None else contextlib.nullcontext():
            loss = model(x, y)
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
    return out


def batches(n, b=4, t=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, b, t + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


@pytest.mark.parametrize("budget", [64 << 20, 0], ids=["host", "nvme"])
def test_gradients_equal_the_run_without_offload(daemon, budget):  # noqa: F811
    torch.manual_seed(1)
    model = GPT(layers=2, d=64, heads=4, ctx=32)
    data = batches(3)
    plain = gradients(model, data)
    client = tierd.connect(daemon, "activations-test")
    offload = tierd.torch.offload_activations(client=client, min_bytes=4096,
                                              host_budget_bytes=budget, slab_bytes=1 << 18,
                                              read_ahead=1)
    offloaded = gradients(model, data, offload)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(plain, offloaded):
        assert torch.equal(loss_a, loss_b)
        for a, b in zip(grads_a, grads_b):
            assert torch.equal(a, b)
    s = offload.stats
    assert s.stored > 0 and s.stored_bytes > 4 * (1 << 18)  # more than a few slabs a forward
    assert s.kept > 0  # parameters and small tensors stay
    slabs = s.slabs
    if budget == 0:
        # Read ahead brings back exactly what went down, each slab once.
        assert s.nvme_written_bytes > 0 and s.nvme_read_bytes == s.nvme_written_bytes
    else:
        assert s.nvme_written_bytes == 0 and s.nvme_read_bytes == 0
    # Later forwards reuse the first one's slabs: no call to the daemon per saved tensor, and
    # none at all for host slabs (they stay acquired); NVMe slabs are acquired again each pass.
    acquired = client.stats()
    gradients(model, data, offload)
    assert offload.stats.slabs == slabs
    after = client.stats()
    again = (after.acquired_ready + after.acquired_waited) - (acquired.acquired_ready +
                                                               acquired.acquired_waited)
    assert again == 0 if budget else again >= 2 * slabs
    offload.close()
    client.close()


def test_a_tensor_saved_twice_is_stored_once(daemon):  # noqa: F811
    offload = tierd.torch.offload_activations(socket_dir=daemon, min_bytes=1024)
    x = torch.randn(64, 64, requires_grad=True)
    with offload:
        a = x * 2             # saves nothing of size (a scalar factor)
        y = a * a             # saves `a` twice: once stored
        z = (a.sin() * 3).sum() + y.sum()  # sin saves `a` again, and `a` is still alive
    before = offload.stats
    assert before.deduplicated == 2
    assert before.stored_bytes == 64 * 64 * 4 * before.stored
    z.backward()
    assert torch.allclose(x.grad, 2 * (2 * (2 * x.detach())) + 3 * torch.cos(2 * x.detach()) * 2)
    offload.close()


def test_a_graph_dropped_without_backward_gives_its_slabs_back(daemon):  # noqa: F811
    torch.manual_seed(2)
    model = GPT(layers=1, d=64, heads=4, ctx=32)
    offload = tierd.torch.offload_activations(socket_dir=daemon, min_bytes=4096,
                                              host_budget_bytes=0, slab_bytes=1 << 18)
    x, y = batches(1)[0]
    with offload:
        loss = model(x, y)
    slabs = offload.stats.slabs
    with pytest.raises(RuntimeError):
        offload.close()  # the graph still holds tensors in the slabs
    del loss
    gc.collect()
    for _ in range(3):
        with offload:
            loss = model(x, y)
        loss.backward()
    assert offload.stats.slabs == slabs
    with tierd.connect(daemon) as observer:
        used = observer.tier_usage(tierd.Tier.HOST).used_bytes
        offload.close()
        assert observer.tier_usage(tierd.Tier.HOST).used_bytes <= used


def test_a_forward_cannot_nest_and_bad_arguments_are_refused(daemon):  # noqa: F811
    with pytest.raises(ValueError):
        tierd.torch.offload_activations(socket_dir=daemon, min_bytes=0)
    offload = tierd.torch.offload_activations(socket_dir=daemon)
    with offload:
        with pytest.raises(RuntimeError):
            offload.__enter__()
    offload.close()
    with pytest.raises(RuntimeError):
        offload.__enter__()
