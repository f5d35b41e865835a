"""OffloadedAdamW with device_share: a share of the buckets stepped by the daemon's device (here the
emulated one, which runs the CPU kernels on its memory) beside the CPU lane. Against the same
optimizer with every bucket on the CPU, trained on the same model, seed and data: the same losses
and weights bit for bit, with state on NVMe and in the host tier, with gradients taken during
backward, with speculative clipping that rolls back, and through a state_dict; the auto share; state
kept on the device between steps; and the refusals."""
import os
import sys
import tempfile

import pytest
import torch

from test_c_abi import daemon, start_daemon, stop_daemon  # noqa: F401 (daemon: a fixture)
from test_torch_optimizer import HYPER, batches, model, train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import tierd  # noqa: E402
import tierd.torch  # noqa: E402

STEPS = 12


def run(daemon, share, steps=STEPS, **kwargs):  # noqa: F811
    """Trains the test model with this device share; its losses, model, and each step's stats."""
    m = model()
    options = dict(HYPER, socket_dir=daemon, host_budget_bytes=1 << 20, threads=2,
                   bucket_params=40_000, device_share=share)
    options.update(kwargs)
    opt = tierd.torch.OffloadedAdamW(m.parameters(), **options)
    stats = []
    try:
        losses = []
        for batch in batches(steps):
            losses += train(m, opt, [batch], clip=kwargs.get("max_grad_norm"))
            stats.append(dict(opt.last_stats))
        state = opt.state_dict()
    finally:
        opt.close()
    return losses, m, stats, state


def assert_bit_equal(a, b):
    assert a[0] == b[0], "losses differ"
    for (name, p), q in zip(a[1].named_parameters(), b[1].parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("home,overlap,share", [("nvme", False, 0.5), ("nvme", True, 1.0),
                                                ("host", True, 0.5), ("nvme", True, "auto")])
def test_steps_on_the_device_train_bit_for_bit_as_on_the_cpu(daemon, home, overlap,  # noqa: F811
                                                              share):
    cpu = run(daemon, None, home=home, overlap_backward=overlap)
    split = run(daemon, share, home=home, overlap_backward=overlap)
    assert_bit_equal(cpu, split)
    params = sum(p.numel() for p in split[1].parameters())
    for s in split[2]:
        assert s["device_params"] > 0 and s["device_busy_s"] > 0, s
        assert s["host_params"] + s["device_params"] == params
    if share == 1.0:
        assert all(s["host_params"] == 0 and s["device_share"] == 1.0 for s in split[2])
    else:  # the first bucket (embedding, 6144) and the second (196,864) of three
        assert all(0.0 < s["device_share"] < 1.0 for s in split[2]), split[2]
    assert "device_params" not in cpu[2][-1]


def test_the_buckets_whose_gradients_come_last_go_to_the_device(daemon):  # noqa: F811
    # Backward gives the last layer's gradients first: the device gets the first buckets.
    sizes = [p.numel() for p in model().parameters()]
    _, _, stats, _ = run(daemon, 0.03, steps=2, overlap_backward=True)
    # The embedding's bucket alone, from the first step (the layout's order) on.
    assert [s["device_params"] for s in stats] == [sizes[0]] * 2
    _, _, stats, _ = run(daemon, 0.0, steps=2, overlap_backward=True)
    assert stats[-1]["device_params"] == 0


class _Bucket:
    def __init__(self, serial, numel, master=tierd._abi.ADAM_MASTER_IN_STATE):
        self.serial, self.numel, self.active, self.master = serial, numel, True, master


def test_a_bucket_whose_master_weights_are_its_out_stays_on_the_host():
    """Streamed fp32 weights that are their own master (scratch state) are stepped by the CPU:
    the device lane would step a copy of them, not the weights."""
    lanes = tierd.torch._lanes.DeviceLanes(1.0)
    owned = [_Bucket(0, 10), _Bucket(1, 30, tierd._abi.ADAM_MASTER_IN_OUT), _Bucket(2, 20)]
    assert sorted(b.serial for b in lanes.choose(owned, 1.0)) == [0, 2]


def test_the_share_is_placed_in_whole_buckets_from_the_last_to_arrive():
    lanes = tierd.torch._lanes.DeviceLanes(0.5)
    owned = [_Bucket(s, n) for s, n in enumerate([10, 30, 20, 40])]
    # Before any step: the layout's order is backward's, so the last buckets laid out go first.
    assert [b.serial for b in lanes.choose(owned, 0.5)] == [3, 2]
    assert lanes.share == 0.6
    assert [b.serial for b in lanes.choose(owned, 0.45)] == [3]  # 0.4 is nearer than 0.6
    assert lanes.choose(owned, 0.1) == [] and lanes.share == 0.0  # nearer than the 0.4 of one
    assert [b.serial for b in lanes.choose(owned, 1.0)] == [3, 2, 1, 0]
    # After a step: the order its buckets were launched in.
    for serial in (2, 0, 3, 1):
        lanes.launched(owned[serial])
    assert [b.serial for b in lanes.choose(owned, 0.3)] == [1]
    assert [b.serial for b in lanes.choose(owned, 0.7)] == [1, 3]
    owned[1].active = False  # a bucket whose parameters left the groups is not placed
    assert [b.serial for b in lanes.choose(owned, 0.5)] == [3]
    auto = tierd.torch._lanes.DeviceLanes("auto")
    assert lanes.target() == 0.5 and auto.target() == 0.5  # auto, before a measurement
    auto.measured = 0.2
    assert auto.target() == 0.2


def layers(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])


def test_auto_takes_the_share_the_lanes_measured_rates_balance():
    # Eight buckets of one layer each (about an eighth of the share each), the state on NVMe for
    # both lanes. Over a slow link (5 MB/s each way) the device lane costs far more a parameter
    # than the CPU: "auto" soon gives it at most one bucket of the eight (none in the release
    # build). Over the emulated PCIe link, where both lanes run the same kernels, about half as
    # the rates measure (two buckets under ASan beside other tests): more than the slow link's by
    # a bucket at least, whatever the load.
    finals = {}
    for gbps in ("0.005", "24"):
        with tempfile.TemporaryDirectory(prefix="tierd-py-") as root:
            proc = start_daemon(root, "--device=emulated", "--device_capacity=32MiB",
                                "--device_segment_size=16MiB", f"--emulated_gbps={gbps}",
                                "--probe_bytes=0")
            try:
                m = layers()
                opt = tierd.torch.OffloadedAdamW(
                    m.parameters(), **HYPER, socket_dir=root, host_budget_bytes=1 << 20,
                    threads=2, bucket_params=20_000, home="nvme", overlap_backward=True,
                    device_share="auto")
                try:
                    shares = []
                    for step in range(5):
                        x = torch.randn(16, 128, generator=torch.Generator().manual_seed(step))
                        m(x).square().mean().backward()
                        opt.step()
                        opt.zero_grad()
                        shares.append(opt.last_stats["device_share"])
                finally:
                    opt.close()
            finally:
                stop_daemon(proc, root)
        assert shares[0] == pytest.approx(0.5, abs=0.07), shares  # unmeasured: about half
        finals[gbps] = shares[-1]
    bucket = 1 / 8
    assert finals["0.005"] <= bucket, finals
    assert finals["24"] >= finals["0.005"] + bucket * 0.9, finals


def test_clipping_that_rolls_back_a_speculative_step_is_exact_on_the_device(daemon):  # noqa: F811
    options = dict(overlap_backward=True, max_grad_norm=0.5, home="nvme")
    cpu = run(daemon, None, **options)
    split = run(daemon, 0.5, **options)
    assert_bit_equal(cpu, split)
    # The state_dict (moments and steps) is the CPU's too.
    for key, state in cpu[3]["state"].items():
        for part, value in state.items():
            other = split[3]["state"][key][part]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (key, part)


def test_the_share_set_between_steps_is_placed_at_once(daemon):  # noqa: F811
    cpu = run(daemon, None, home="nvme", overlap_backward=True)
    m = model()
    opt = tierd.torch.OffloadedAdamW(m.parameters(), **HYPER, socket_dir=daemon,
                                     host_budget_bytes=1 << 20, threads=2, bucket_params=40_000,
                                     home="nvme", overlap_backward=True)
    settings = {3: 0.5, 6: None, 9: "auto"}
    losses, on_device = [], []
    try:
        for step, batch in enumerate(batches(STEPS)):
            if step in settings:
                opt.device_share = settings[step]
                assert opt.device_share == settings[step]
            losses += train(m, opt, [batch])
            on_device.append(opt.last_stats.get("device_params", 0.0))
    finally:
        opt.close()
    assert_bit_equal(cpu, (losses, m))
    assert on_device[:3] == [0.0] * 3 and all(n > 0 for n in on_device[3:6])
    assert on_device[6:9] == [0.0] * 3 and all(n > 0 for n in on_device[9:])


@pytest.mark.parametrize("clip", [None, 0.05])
def test_state_kept_on_the_device_crosses_the_link_once_and_trains_as_on_the_cpu(
        daemon, clip):  # noqa: F811
    # Every bucket on the device, all their state kept there between steps (both versions when
    # clipping steps speculatively; at 0.05 some steps roll back and are stepped again).
    kwargs = dict(home="nvme", overlap_backward=True, max_grad_norm=clip)
    cpu = run(daemon, None, **kwargs)
    up = {}
    for budget in (0, 64 << 20):
        with tierd.connect(daemon, "meter") as meter:
            before = meter.path_bytes("host_to_device")
            got = run(daemon, 1.0, device_budget_bytes=budget, **kwargs)
            up[budget] = meter.path_bytes("host_to_device") - before
        assert_bit_equal(cpu, got)
        stats = got[2]
        if budget:
            assert all(s["device_kept_bytes"] == s["state_bytes"] > 0 for s in stats), stats
        else:
            assert all(s["device_kept_bytes"] == 0 for s in stats), stats
    if clip is not None:
        assert any(s["rolled_back"] for s in cpu[2]), "no step rolled back: clip lower"
    # Kept: the state went up once, in the first step. Sent home after each step: every step.
    state = stats[0]["state_bytes"]
    assert up[64 << 20] == state, up
    assert up[0] >= STEPS * state, up


def test_device_budget_bytes_is_refused_clearly_where_it_cannot_be(daemon):  # noqa: F811
    m = model()
    for bad in (-1, 1.5, "1GiB", True):
        with pytest.raises(ValueError, match="device_budget_bytes"):
            tierd.torch.OffloadedAdamW(m.parameters(), socket_dir=daemon, device_share=0.5,
                                       device_budget_bytes=bad)
    with pytest.raises(ValueError, match="persistent"):
        tierd.torch.OffloadedAdamW(m.parameters(), socket_dir=daemon, device_share=0.5,
                                   name="kept", device_budget_bytes=1 << 20)
    with tempfile.TemporaryDirectory(prefix="tierd-py-") as root:
        proc = start_daemon(root, "--device=none", "--probe_bytes=0")
        try:
            with pytest.raises(RuntimeError, match="device tier") as refused:
                tierd.torch.OffloadedAdamW(m.parameters(), socket_dir=root,
                                           device_budget_bytes=1 << 20)
            assert isinstance(refused.value, tierd.FailedPrecondition)
        finally:
            stop_daemon(proc, root)


def test_device_share_is_refused_clearly_where_it_cannot_be(daemon):  # noqa: F811
    m = model()
    for bad in (1.5, -0.1, "fast", True):
        with pytest.raises(ValueError, match="device_share"):
            tierd.torch.OffloadedAdamW(m.parameters(), socket_dir=daemon, device_share=bad)
    with pytest.raises(tierd.TierdError, match="fp32 moments"):
        tierd.torch.OffloadedAdamW(m.parameters(), socket_dir=daemon, device_share=0.5,
                                   state_dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory(prefix="tierd-py-") as root:
        proc = start_daemon(root, "--device=none", "--probe_bytes=0")
        try:
            with pytest.raises(tierd.TierdError, match="device tier"):
                tierd.torch.OffloadedAdamW(m.parameters(), socket_dir=root, device_share=0.5)
            opt = tierd.torch.OffloadedAdamW(m.parameters(), socket_dir=root)
            try:
                with pytest.raises(RuntimeError, match="device tier") as refused:
                    opt.device_share = "auto"
                assert isinstance(refused.value, tierd.FailedPrecondition)
                assert opt.device_share is None
                with pytest.raises(ValueError, match="device_share"):
                    opt.device_share = 2
            finally:
                opt.close()
        finally:
            stop_daemon(proc, root)


@pytest.mark.parametrize("case", ["nvme", "clipping rolls back"])
def test_streamed_units_step_on_the_device_as_on_the_cpu(daemon, case):  # noqa: F811
    # The example GPT with its blocks streamed (from NVMe: their gradients in the daemon's chunks).
    from test_streaming import CASES, assert_equal
    from test_streaming import train as train_streamed
    kwargs = dict(CASES[case])
    want = train_streamed(daemon, True, **kwargs)
    got = train_streamed(daemon, True, device_share=0.5, **kwargs)
    assert_equal(got, want)


@pytest.mark.parametrize("case", ["host", "nvme", "accumulation", "clipping rolls back"])
def test_streamed_gradients_stay_in_the_device_tier_for_the_device_lane(daemon,  # noqa: F811
                                                                        case):
    # Every streamed bucket on the device: each range holds its gradients in the daemon's device
    # tier, so none is counted off the device; the training is the CPU's, bit for bit (with
    # gradients summed over two backward passes, and kept for a step taken again).
    from test_streaming import CASES, assert_equal
    from test_streaming import train as train_streamed
    kwargs = dict(CASES[case])
    want = train_streamed(daemon, True, **kwargs)
    got = train_streamed(daemon, True, device_share=1.0, **kwargs)
    assert_equal(got, want)
    assert want[3]["stats"]["d2h_bytes"] > 0
    assert got[3]["stats"]["d2h_bytes"] == 0
    if case == "clipping rolls back":
        assert got[3]["rolled_back"] > 0


def test_gradients_without_room_in_the_device_tier_are_held_in_the_host():
    # A 2 MiB device tier and blocks whose gradients take 3 MiB each: they are held in the host
    # (counted off the device) and the training is the CPU's, bit for bit.
    import test_streaming as ts
    with tempfile.TemporaryDirectory(prefix="tierd-py-") as root:
        proc = start_daemon(root, "--device=emulated", "--device_capacity=2MiB",
                            "--device_segment_size=2MiB")
        try:
            runs = {}
            for share in (None, 1.0):
                torch.manual_seed(0)
                model = ts.Variants(2, 256, 4, ts.CTX)
                assert sum(p.numel() for p in model.blocks[0].parameters()) * 4 > 2 << 20
                runs[share] = ts.train(root, True, steps=3, model=model, device_share=share)
            ts.assert_equal(runs[1.0], runs[None])
            assert runs[1.0][3]["stats"]["d2h_bytes"] == runs[None][3]["stats"]["d2h_bytes"] > 0
        finally:
            stop_daemon(proc, root)


@pytest.mark.parametrize("units", ["host", "nvme"])
def test_gradients_held_on_the_device_follow_their_bucket_to_the_host(daemon,  # noqa: F811
                                                                      units):
    # Two backward passes a step; between them every bucket leaves the device (and, a step
    # later, comes back). Gradients the first pass left in the device tier are held again in the
    # host for the CPU's kernels: the second pass brings them down (the emulated device's kernels
    # could read them where they are; a GPU's host lane could not). Units at home on the host and
    # on NVMe (whose buckets page their gradients); the training is the CPU's, bit for bit.
    import test_streaming as ts
    results, down = {}, []
    for moved in (False, True):
        model = ts.make()
        stream = tierd.torch.stream_parameters(
            model, device=torch.device("cpu"), device_budget_bytes=ts.budget(model),
            socket_dir=daemon, **(dict(host_budget_bytes=0) if units == "nvme" else {}))
        opt = tierd.torch.OffloadedAdamW(
            model.parameters(), **ts.HYPER, socket_dir=daemon, overlap_backward=True, threads=2,
            accumulation_steps=2, host_budget_bytes=1 << 20, home="host",
            device_share=1.0 if moved else None)
        losses = []
        try:
            with tierd.connect(daemon, "meter") as meter:
                for step in range(4):
                    for k in range(2):
                        before = meter.path_bytes("device_to_host")
                        x, y = ts.batch(step * 2 + k)
                        loss = model(x, y)
                        losses.append(loss.item())
                        loss.backward()
                        if moved and (step, k) == (1, 1):  # on the host since the first pass
                            down.append(meter.path_bytes("device_to_host") - before)
                        if moved and k == 0 and step in (1, 2):
                            opt.device_share = None if step == 1 else 1.0
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            results[moved] = losses, ts.weights_of(model, stream)
        finally:
            opt.close()
            stream.close()
    assert len(down) == 1 and down[0] > 0, down
    assert results[True][0] == results[False][0]
    for k, v in results[False][1].items():
        assert torch.equal(results[True][1][k], v), k


def test_two_ranks_step_their_shares_on_the_device_as_on_the_cpu(daemon, tmp_path):  # noqa: F811
    # Sharded over two ranks (ZeRO-1): each rank places its own buckets; with all of them on the
    # device the training is the CPU's, bit for bit, on both ranks.
    from test_torch_zero import HERE as ZERO_HERE, torchrun
    got = {}
    for share in (None, 1.0):
        out = str(tmp_path / f"ranks-{share}.pt")
        flags = ["--home", "nvme", "--steps", "8", "--overlap", "--clip", "0.5"]
        flags += ["--device-share", str(share)] if share is not None else []
        torchrun(os.path.join(ZERO_HERE, "zero_rank.py"), daemon, out, *flags)
        got[share] = torch.load(out)
    cpu, device = got[None], got[1.0]
    assert [r["losses"] for r in device["ranks"]] == [r["losses"] for r in cpu["ranks"]]
    for a, b in zip(cpu["params"], device["params"]):
        assert torch.equal(a, b)
    assert torch.equal(device["weights_of_ranks"][0], device["weights_of_ranks"][1])
    assert all(r["device_params"] > 0 for r in device["ranks"]), device["ranks"]
    assert all(r["device_params"] is None for r in cpu["ranks"])
