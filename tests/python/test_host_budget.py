"""OffloadedAdamW's host budget by default ("auto"): the daemon's host tier rather than a fixed
number, so that the optimizer neither asks for more of the tier than there is (and drops and reads
its own state again each step) nor leaves a large tier unused. For parameters in memory, the room
free in the tier: state that fits stays at home there; for streamed parameters half the tier, their
weights and gradients passing through the rest, or less where their weights need more of it to
stay there; split among a job's ranks on the node. The state goes to NVMe when it outgrows the
budget or the room other jobs' state leaves free."""
import os
import sys
import tempfile
import time
import warnings

import pytest
import torch

from test_c_abi import daemon, start_daemon, stop_daemon  # noqa: F401 (daemon: a fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import tierd.torch  # noqa: E402
from train_gpt import GPT  # noqa: E402

TIER = 32 << 20  # start_daemon's host tier


def linear(features):
    torch.manual_seed(0)
    return torch.nn.Linear(features, features, bias=False)


def free(socket_dir):
    with tierd.connect(socket_dir, "probe") as c:
        return c.tier_usage(tierd.Tier.HOST).free_bytes


def emptied(socket_dir):
    """Waits until the chunks of the sessions closed before are freed: the tier is all free."""
    deadline = time.monotonic() + 30
    while free(socket_dir) < TIER:
        assert time.monotonic() < deadline, "the tier was not emptied"
        time.sleep(0.05)


def train(model, opt, steps):
    """Trains the GPT `steps` steps; they are all taken."""
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 17))
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    assert opt.steps_taken == steps


def test_auto_is_the_host_tiers_free_room_split_among_the_nodes_ranks(
        daemon, monkeypatch):  # noqa: F811
    room = free(daemon)
    opt = tierd.torch.OffloadedAdamW(linear(64).parameters(), socket_dir=daemon)
    assert (opt.host_budget_bytes, opt.home) == (room, "host")
    opt.close()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    opt = tierd.torch.OffloadedAdamW(linear(64).parameters(), socket_dir=daemon)
    assert opt.host_budget_bytes == TIER // 4
    opt.close()
    opt = tierd.torch.OffloadedAdamW(linear(64).parameters(), socket_dir=daemon,
                                     host_budget_bytes=5 << 20)
    assert opt.host_budget_bytes == 5 << 20  # a number is taken as it is
    opt.close()


def test_auto_is_half_the_host_tier_for_streamed_parameters(daemon):  # noqa: F811
    torch.manual_seed(0)
    model = GPT(4, 32, 2, 16)
    stream = tierd.torch.stream_parameters(model, device=torch.device("cpu"), socket_dir=daemon)
    opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon,
                                     overlap_backward=True)
    try:
        assert opt.host_budget_bytes == TIER // 2
        train(model, opt, 1)  # and it steps
    finally:
        opt.close()
        stream.close()


def test_auto_leaves_streamed_weights_larger_than_half_the_tier_their_room():
    # 4.8 M fp32 parameters in 8 blocks, 18.5 MiB of streamed weights at home on NVMe: with an
    # eighth of the tier to pass through, more than half of it, so the optimizer gets what is
    # left beyond them. (Two versions of the weights, their gradients and the moments take more
    # NVMe than the shared daemon's.)
    torch.manual_seed(0)
    model = GPT(8, 224, 4, 16)
    weights = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    with tempfile.TemporaryDirectory(prefix="tierd-py-") as root:
        proc = start_daemon(root, f"--nvme_regions={root}/nvme.region:256MiB")
        try:
            stream = tierd.torch.stream_parameters(model, device=torch.device("cpu"),
                                                   socket_dir=root, host_budget_bytes=0)
            opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=root,
                                             overlap_backward=True)
            try:
                assert opt.host_budget_bytes == TIER - weights - TIER // 8
                assert TIER // 8 < opt.host_budget_bytes < TIER // 2
                assert opt.home == "nvme"
                train(model, opt, 2)
            finally:
                opt.close()
                stream.close()
        finally:
            stop_daemon(proc, root)


def test_state_beside_streamed_weights_goes_to_nvme_rather_than_starve_them(daemon):  # noqa: F811
    # 2.5 M fp32 parameters, their own master: 20 MiB of moments, within a 1 GiB budget (the
    # old default) and the tier, but more than the half of it the stream's blocks (at home on
    # NVMe) leave. At home in the host it would take the room the blocks wait for, for good.
    torch.manual_seed(0)
    model = GPT(4, 224, 4, 16)
    stream = tierd.torch.stream_parameters(model, device=torch.device("cpu"), socket_dir=daemon,
                                           host_budget_bytes=0)
    with pytest.warns(RuntimeWarning, match="more than this rank's share"):
        opt = tierd.torch.OffloadedAdamW(model.parameters(), socket_dir=daemon,
                                         host_budget_bytes=1 << 30)
    try:
        assert opt.home == "nvme"
        train(model, opt, 2)
    finally:
        opt.close()
        stream.close()


def test_state_larger_than_the_budget_or_the_free_room_is_at_home_on_nvme(daemon):  # noqa: F811
    # 8 bytes of moments a parameter (fp32 weights are their own master without a device tier,
    # and with one the state also holds 4 bytes of master weights): 2048² parameters need at
    # least 32 MiB, more than the tier.
    emptied(daemon)
    big = tierd.torch.OffloadedAdamW(linear(2048).parameters(), socket_dir=daemon)
    assert big.home == "nvme"
    big.close()
    # 1024² parameters need 8 or 12 MiB: at home on the host while the tier has that room free,
    # on NVMe once other jobs' state at home there takes it.
    first = tierd.torch.OffloadedAdamW(linear(1024).parameters(), socket_dir=daemon)
    second = tierd.torch.OffloadedAdamW(linear(1024).parameters(), socket_dir=daemon)
    third = tierd.torch.OffloadedAdamW(linear(1024).parameters(), socket_dir=daemon)
    try:
        assert first.home == "host"
        assert "nvme" in (second.home, third.home)
    finally:
        for o in (first, second, third):
            o.close()


def test_a_budget_beyond_the_ranks_share_of_the_tier_warns(daemon, monkeypatch):  # noqa: F811
    # 32 MiB of moments: at home on NVMe, streamed through the budget.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tierd.torch.OffloadedAdamW(linear(2048).parameters(), socket_dir=daemon,
                                   host_budget_bytes=TIER // 4).close()
    with pytest.warns(RuntimeWarning, match=f"host_budget_bytes {TIER // 2} is more than this "
                      f"rank's share of the daemon's host tier \\({TIER // 4} bytes\\)"):
        opt = tierd.torch.OffloadedAdamW(linear(2048).parameters(), socket_dir=daemon,
                                         host_budget_bytes=TIER // 2)
    assert (opt.home, opt.host_budget_bytes) == ("nvme", TIER // 2)  # taken as it is
    opt.close()


def test_persistent_state_resumes_with_the_home_and_budget_it_was_made_with(daemon):  # noqa: F811
    # 1300² parameters, 20 MiB of state with its master weights: at home in the 32 MiB tier,
    # where it stays between runs, leaving less free than it holds when the next run resumes it.
    made = tierd.torch.OffloadedAdamW(linear(1300).parameters(), socket_dir=daemon,
                                      name="budget-resume", reset=True)
    assert (made.home, made.host_budget_bytes) == ("host", TIER)
    made.close()
    assert free(daemon) < 20 << 20
    resumed = tierd.torch.OffloadedAdamW(linear(1300).parameters(), socket_dir=daemon,
                                         name="budget-resume", resume=True)
    try:
        assert resumed.resumed
        assert (resumed.home, resumed.host_budget_bytes) == ("host", TIER)
    finally:
        resumed.close()
        tierd.torch.OffloadedAdamW(linear(1300).parameters(), socket_dir=daemon,
                                   name="budget-resume", reset=True, home="nvme").close()


@pytest.mark.parametrize("bad", ["big", -1, True, 1.5, None])
def test_a_budget_that_is_not_auto_or_a_byte_count_is_refused(daemon, bad):  # noqa: F811
    with pytest.raises(ValueError, match="host_budget_bytes must be 'auto' or an int >= 0"):
        tierd.torch.OffloadedAdamW(linear(8).parameters(), socket_dir=daemon,
                                   host_budget_bytes=bad)


def test_without_nvme_the_state_stays_at_home_on_the_host():
    with tempfile.TemporaryDirectory(prefix="tierd-py-") as root:
        proc = start_daemon(root, "--nvme_regions=none", "--device=none", "--probe_bytes=0")
        try:
            room = free(root)
            opt = tierd.torch.OffloadedAdamW(linear(1024).parameters(), socket_dir=root)
            assert (opt.home, opt.host_budget_bytes) == ("host", room)
            opt.close()
        finally:
            stop_daemon(proc, root)
