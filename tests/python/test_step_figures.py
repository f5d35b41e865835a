"""StepFigures (tierd/torch/_step_figures.py): each step's figures for a training loop's logs,
read from a real daemon and a real stream.

The counters are means a step over the steps since the last take(): the stream's (weights to the
device, gradients off it, the wait for weights) as the stream counted them, the daemon's NVMe bytes
as it moved them (every session's: bytes another session moves between two takes are in them); the
optimizer's times are its last step's; the host tier's use is as it is when taken. A take() with
no step since gives nothing; figures of something that is not an OffloadedAdamW are refused.
"""
import pytest
import torch

from test_c_abi import daemon  # noqa: F401 (a fixture)
from test_pretrained import HYPER, on_meta, stream, tokens

import tierd.torch  # noqa: E402 (test_pretrained puts python/ on the path)
from tierd.client import Tier, connect  # noqa: E402

NAMES = {"nvme_read_bytes", "nvme_written_bytes", "host_tier_used_bytes", "weights_wait_s",
         "h2d_bytes", "d2h_bytes", "optimizer_tail_s", "optimizer_state_wait_s"}


def _step(model, opt, i):
    x = tokens(i)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def streamed(daemon):  # noqa: F811
    """(model, stream, optimizer): a Llama of 4 blocks streamed, its blocks at home on NVMe."""
    torch.manual_seed(0)
    model = on_meta("llama")
    s = stream(model, daemon, init=None, host_budget_bytes=0)
    opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon, **HYPER)
    yield model, s, opt
    opt.close()
    s.close(keep_weights=False)


def test_each_step_gives_every_figure_and_the_streams_as_it_counted_them(streamed):
    model, s, opt = streamed
    with tierd.torch.StepFigures(opt) as figures:
        assert figures.stream is s  # found from the optimizer's parameters
        before = s.stats
        _step(model, opt, 0)
        _step(model, opt, 1)
        got = figures.take()
        after = s.stats
    assert {k[len("tierd/"):] for k in got} == NAMES
    assert all(k.startswith("tierd/") for k in got)
    # Two steps since the figures were made: the means a step of what the stream counted.
    for name, key in (("h2d_bytes", "h2d_bytes"), ("d2h_bytes", "d2h_bytes"),
                      ("weights_wait_s", "wait_s")):
        assert got["tierd/" + name] == pytest.approx((after[key] - before[key]) / 2)
    assert got["tierd/h2d_bytes"] > 0 and got["tierd/d2h_bytes"] > 0
    assert got["tierd/optimizer_tail_s"] == opt.last_stats["tail_s"]
    assert got["tierd/optimizer_state_wait_s"] == opt.last_stats["state_wait_s"]
    assert got["tierd/host_tier_used_bytes"] > 0  # the stream's chunks, at least


def test_the_daemons_nvme_bytes_are_what_it_moved_between_two_takes(streamed, daemon):  # noqa: F811
    model, s, opt = streamed
    size = 4 << 20
    with connect(daemon, "other") as other, tierd.torch.StepFigures(opt) as figures:
        _step(model, opt, 0)
        figures.take()
        reads, writes = other.path_bytes("nvme_to_host"), other.path_bytes("host_to_nvme")
        with other.allocate([size]) as chunks:  # another session's bytes, down and back up
            other.evict(chunks, Tier.NVME).wait()
            other.prefetch(chunks, Tier.HOST).wait()
            _step(model, opt, 1)
            got = figures.take()
            read = other.path_bytes("nvme_to_host") - reads
            written = other.path_bytes("host_to_nvme") - writes
    # One step between the takes; the take read the counters between the two readings here.
    assert size <= got["tierd/nvme_read_bytes"] <= read
    assert size <= got["tierd/nvme_written_bytes"] <= written


def test_no_step_since_the_last_take_gives_nothing(streamed):
    model, s, opt = streamed
    with tierd.torch.StepFigures(opt) as figures:
        assert figures.take() == {}
        _step(model, opt, 0)
        assert figures.take() != {}
        assert figures.take() == {}


def test_unstreamed_parameters_give_the_daemons_figures_and_the_optimizers(daemon):  # noqa: F811
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon, lr=1e-3)
    try:
        with tierd.torch.StepFigures(opt) as figures:
            assert figures.stream is None
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            got = figures.take()
    finally:
        opt.close()
    assert {k[len("tierd/"):] for k in got} == NAMES - {"weights_wait_s", "h2d_bytes",
                                                         "d2h_bytes"}


def test_figures_of_another_optimizer_are_refused():
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="OffloadedAdamW, not AdamW"):
        tierd.torch.StepFigures(opt)
