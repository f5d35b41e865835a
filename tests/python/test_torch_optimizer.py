"""tierd.torch.OffloadedAdamW against torch.optim.AdamW on the same model, seed and data, through a
real daemon: state in the host tier and streamed from NVMe, gradients taken at step() and during
backward, clipping that triggers, accumulation, loss scaling, a skipped non-finite step, state_dict
both ways, and resuming by name after the daemon restarts. Where the daemon serves no device tier,
fp32 weights are their own master (the state holds the moments only): the tests that step run
both ways."""
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from test_c_abi import daemon, start_daemon, stop_daemon  # noqa: F401 (daemon: a fixture)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import tierd  # noqa: E402
import tierd.torch  # noqa: E402

STEPS = 50
BUDGET = 1 << 20  # the model's state is 2.9 MB: streamed through a third of it


@pytest.fixture(params=["device tier", "no device tier"])
def any_daemon(request):
    """A daemon with an (emulated) device tier, where OffloadedAdamW keeps fp32 master weights in
    its state so that device_share can place them, and one without, where the weights it keeps
    in fp32 anyway are the master."""
    if request.param == "device tier":
        yield request.getfixturevalue("daemon")
        return
    with tempfile.TemporaryDirectory(prefix="tierd-py-") as root:
        proc = start_daemon(root, "--device=none", "--probe_bytes=0")
        try:
            yield root
        finally:
            stop_daemon(proc, root)


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 96), torch.nn.Flatten(), torch.nn.Linear(8 * 96, 256),
        torch.nn.GELU(), torch.nn.LayerNorm(256), torch.nn.Linear(256, 64))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 64, (16, 8), generator=g) for _ in range(n)]
    return [(x, x[:, 2]) for x in xs]  # learnable: the loss must fall


def loss_of(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def train(m, opt, data, micro=1, clip=None, scale=1.0, poison=None, reference=False):
    """Trains and returns the losses. `reference`: opt is a torch AdamW, clipped and skipped here
    the way a torch training loop does it."""
    losses = []
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        total = 0.0
        poisoned = None
        if poison == step:  # an inf in one gradient, as backward produces it
            def bad(g):
                g = g.clone()
                g[0, 0] = float("inf")
                return g
            poisoned = next(iter(m.parameters())).register_hook(bad)
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            loss = loss_of(m, xs, ys) / micro
            (loss * scale).backward()
            total += float(loss.detach())
        if poisoned is not None:
            poisoned.remove()
        losses.append(total)
        if reference:
            grads = [p.grad for p in m.parameters()]
            if scale != 1.0:
                for g in grads:
                    g.mul_(torch.tensor(scale, dtype=torch.float64).reciprocal().float())
            finite = all(torch.isfinite(g).all() for g in grads)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            if poison is None or finite:
                opt.step()
        else:
            opt.step(grad_scale=scale)
    return losses


def assert_same_training(ref_losses, losses, ref_model, got_model):
    # fp32 evaluations of one formula in another order: within rounding, step after step.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert losses[-1] < losses[0] * 0.9, "the loss did not fall"
    for (name, a), b in zip(ref_model.named_parameters(), got_model.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _has_device(socket_dir) -> bool:
    with tierd.connect(socket_dir) as c:
        return c.tier_usage(tierd.Tier.DEVICE).configured


def offloaded(m, daemon, **kwargs):  # noqa: F811
    options = dict(HYPER, socket_dir=daemon, host_budget_bytes=BUDGET, threads=2)
    options.update(kwargs)
    return tierd.torch.OffloadedAdamW(m.parameters(), **options)


@pytest.mark.parametrize("home,overlap", [("host", False), ("nvme", False), ("nvme", True)])
def test_trains_as_torch_adamw_does(any_daemon, home, overlap):
    data = batches(STEPS)
    ref = model()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data, reference=True)
    m = model()
    opt = offloaded(m, any_daemon, home=home, overlap_backward=overlap, bucket_params=40_000)
    try:
        # Master weights, exp_avg and exp_avg_sq: 12 bytes a parameter (and a little per
        # tensor); without a device tier the fp32 weights are their own master: 8.
        n = sum(p.numel() for p in m.parameters())
        per = 12 if _has_device(any_daemon) else 8
        assert opt.home == home and per * n <= opt.state_bytes < (per + 1) * n
        losses = train(m, opt, data)
        assert opt.steps_taken == STEPS
        assert opt.last_stats["state_bytes"] == opt.state_bytes
        # During backward, every bucket but the last to arrive was stepped already.
        assert opt.last_stats["buckets_during_backward"] == (
            opt.last_stats["buckets"] if overlap else 0)
        assert opt.last_stats["buckets"] == 3
    finally:
        opt.close()
    assert_same_training(ref_losses, losses, ref, m)


# Global norms run from 8.8 down to 0.8 over the 50 steps: clipped at 0.5 every step, at 5.0 for
# the first twenty or so.
@pytest.mark.parametrize("overlap,clip", [(False, 0.5), (True, 0.5), (True, 5.0)])
def test_clipping_that_triggers_and_accumulation(any_daemon, overlap, clip):
    data = batches(STEPS, seed=2)
    ref = model()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data, micro=2,
                       clip=clip, reference=True)
    m = model()
    opt = offloaded(m, any_daemon, home="nvme", max_grad_norm=clip, overlap_backward=overlap,
                    accumulation_steps=2, bucket_params=40_000)
    try:
        losses = train(m, opt, data, micro=2)
        if clip == 0.5:
            assert opt.last_grad_norm > 0.5  # it clipped
        if overlap:
            # Stepped during backward every step; discarded and stepped again where it clipped.
            assert opt.rolled_back_steps == STEPS if clip == 0.5 else \
                0 < opt.rolled_back_steps < STEPS, opt.rolled_back_steps
            if clip == 5.0:
                assert opt.last_stats["rolled_back"] == 0
                assert opt.last_stats["buckets_during_backward"] == opt.last_stats["buckets"]
    finally:
        opt.close()
    assert_same_training(ref_losses, losses, ref, m)


@pytest.mark.parametrize("overlap", [False, True])
def test_loss_scaling_and_a_skipped_non_finite_step(any_daemon, overlap):
    data = batches(20, seed=3)
    ref = model()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data, scale=1024.0,
                       poison=7, reference=True)
    m = model()
    opt = offloaded(m, any_daemon, home="nvme", skip_nonfinite=True, overlap_backward=overlap,
                    bucket_params=40_000)
    try:
        losses = train(m, opt, data, scale=1024.0, poison=7)
        assert opt.skipped_steps == 1 and opt.steps_taken == 19
        # Overlapped: the first step was stepped at the scale of none before it (1) and the
        # poisoned one as if finite: both discarded; the other 18 kept what backward stepped.
        assert opt.rolled_back_steps == (2 if overlap else 0)
    finally:
        opt.close()
    # The step's figures stay readable once the optimizer is closed.
    assert opt.skipped_steps == 1 and opt.rolled_back_steps == (2 if overlap else 0)
    assert opt.last_stats and opt.last_grad_norm is not None
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for a, b in zip(ref.parameters(), m.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-4, atol=1e-5)


def test_where_the_master_weights_live_changes_nothing_a_user_sees(daemon):  # noqa: F811
    """Masters in the state (a daemon with a device tier) and the weights as their own master (one
    without): bit for bit the same losses and weights, through clipped, rolled-back steps."""
    data = batches(12, seed=6)
    runs = []
    with tempfile.TemporaryDirectory(prefix="tierd-py-") as root:
        proc = start_daemon(root, "--device=none", "--probe_bytes=0")
        try:
            for socket_dir in (daemon, root):
                m = model()
                opt = offloaded(m, socket_dir, home="nvme", max_grad_norm=0.5,
                                overlap_backward=True, bucket_params=40_000)
                try:
                    runs.append((train(m, opt, data), opt.state_bytes, opt.rolled_back_steps,
                                 [p.detach().clone() for p in m.parameters()]))
                finally:
                    opt.close()
        finally:
            stop_daemon(proc, root)
    (in_state, state_bytes, rolled, weights), (in_out, out_bytes, rolled_out, out_weights) = runs
    assert out_bytes < state_bytes and rolled == rolled_out == len(data)
    assert in_state == in_out
    for a, b in zip(weights, out_weights):
        assert torch.equal(a, b)


def test_state_dict_round_trips_with_torch_adamw_both_ways(daemon):  # noqa: F811
    data = batches(20, seed=4)
    # Uninterrupted: torch's AdamW for 20 steps.
    ref = model()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data, reference=True)

    # torch for 7 steps, tierd for 7 (loaded from torch's state_dict), torch again for 6.
    m = model()
    first = torch.optim.AdamW(m.parameters(), **HYPER)
    losses = train(m, first, data[:7], reference=True)
    opt = offloaded(m, daemon, home="nvme")
    try:
        opt.load_state_dict(first.state_dict())
        assert opt.steps_taken == 7
        losses += train(m, opt, data[7:14])
        exported = opt.state_dict()
    finally:
        opt.close()
    assert set(exported["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(exported["state"][0]["step"]) == 14
    last = torch.optim.AdamW(m.parameters(), **HYPER)
    last.load_state_dict(exported)
    losses += train(m, last, data[14:], reference=True)
    assert_same_training(ref_losses, losses, ref, m)


def test_bf16_moments_train_as_fp32_does_with_two_thirds_of_the_state(daemon):  # noqa: F811
    data = batches(STEPS)
    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    ref_losses = train(ref, ref_opt, data, reference=True)
    m = model()
    params = sum(p.numel() for p in m.parameters())
    opt = offloaded(m, daemon, home="nvme", state_dtype=torch.bfloat16, overlap_backward=True,
                    name="pytest/bf16")
    try:
        assert "bf16 moments" in repr(opt)
        assert 8 * params <= opt.state_bytes < 9 * params  # fp32 moments: 12 bytes a parameter
        losses = train(m, opt, data)
        exported = opt.state_dict()
    finally:
        opt.close()
    # Not bit for bit: the moments carry 8 significant bits. Step for step within a percent of
    # fp32's loss, and the moments within a few bf16 ulps of fp32's, exported as fp32 tensors.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=0)
    assert losses[-1] < losses[0] * 0.9, "the loss did not fall"
    ref_state = ref_opt.state_dict()["state"]
    for i, p in enumerate(m.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            got, want = exported["state"][i][key], ref_state[i][key]
            assert got.dtype == torch.float32 and got.shape == p.shape
            assert torch.equal(got, got.bfloat16().float()), "not bf16 values"
            assert (got - want).norm() <= 0.03 * want.norm(), (i, key)

    # Resumed only as what it is.
    with pytest.raises(tierd.TierdError) as other:
        offloaded(model(), daemon, home="nvme", name="pytest/bf16", resume=True)
    assert "keeps m and v in bfloat16" in other.value.message, other.value.message
    again = offloaded(model(), daemon, home="nvme", name="pytest/bf16", resume=True,
                      state_dtype=torch.bfloat16)
    try:
        assert again.steps_taken == STEPS
    finally:
        again.close()
        offloaded(model(), daemon, home="nvme", name="pytest/bf16", reset=True,
                  state_dtype=torch.bfloat16).close()


def test_bad_arguments_are_refused_clearly(daemon):  # noqa: F811
    m = model()
    with pytest.raises(ValueError, match="amsgrad"):
        tierd.torch.OffloadedAdamW(m.parameters(), amsgrad=True, socket_dir=daemon)
    with pytest.raises(TypeError, match="float64"):
        tierd.torch.OffloadedAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))],
                                   socket_dir=daemon)
    with pytest.raises(ValueError, match="max_grad_norm"):
        tierd.torch.OffloadedAdamW(m.parameters(), max_grad_norm=0.0, socket_dir=daemon)
    with pytest.raises(ValueError, match="state_dtype"):
        tierd.torch.OffloadedAdamW(m.parameters(), state_dtype=torch.float16, socket_dir=daemon)
    opt = offloaded(m, daemon, home="host")
    try:
        with pytest.raises(ValueError, match="grad_scale"):
            opt.step(grad_scale=float("inf"))
        other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]).state_dict()
        with pytest.raises(ValueError, match="parameter groups"):
            opt.load_state_dict(other)
    finally:
        opt.close()


def test_a_live_name_is_not_shared_by_accident(daemon):  # noqa: F811
    m = model()
    opt = offloaded(m, daemon, home="nvme", name="pytest/lease")
    try:
        with pytest.raises(tierd.TierdError) as held:
            offloaded(model(), daemon, home="nvme", name="pytest/lease")
        assert str(os.getpid()) in held.value.message, held.value.message
        train(m, opt, batches(2))  # the holder is unharmed
        assert opt.steps_taken == 2
    finally:
        opt.close()


def test_resumes_by_name_after_the_trainer_and_the_daemon_restart():
    data = batches(12, seed=5)
    ref = model()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data, reference=True)
    with tempfile.TemporaryDirectory(prefix="tierd-resume-") as root:
        proc = start_daemon(root, "--device=none", "--probe_bytes=0")
        try:
            m = model()
            opt = offloaded(m, root, home="nvme", name="pytest/run-42", resume=False)
            assert not opt.resumed
            losses = train(m, opt, data[:6])
            with tierd.connect(root) as c:  # the state went down to NVMe and came back up
                assert c.path_bytes("host_to_nvme") >= 6 * opt.state_bytes
                assert c.path_bytes("nvme_to_host") >= 5 * (opt.state_bytes - BUDGET)
                with pytest.raises(tierd.TierdError) as unknown:
                    c.path_bytes("nvme_to_moon")
                assert unknown.value.code_name == "NOT_FOUND"
            opt.close()
        finally:
            stop_daemon(proc, root)
        proc = start_daemon(root, "--device=none", "--probe_bytes=0")
        try:
            m = model(seed=99)  # a fresh process: other initial weights
            with pytest.raises(tierd.TierdError) as typo:
                offloaded(m, root, home="nvme", name="pytest/run-24", resume=True)
            assert typo.value.code_name == "NOT_FOUND"
            with pytest.raises(tierd.TierdError) as exists:
                offloaded(m, root, home="nvme", name="pytest/run-42", resume=False)
            assert exists.value.code_name == "ALREADY_EXISTS"
            opt = offloaded(m, root, home="nvme", name="pytest/run-42", resume=True)
            try:
                assert opt.resumed and opt.steps_taken == 6
                losses += train(m, opt, data[6:])
            finally:
                opt.close()
        finally:
            stop_daemon(proc, root)
    assert_same_training(ref_losses, losses, ref, m)


def test_state_at_home_in_host_memory_survives_a_clean_stop_and_is_lost_in_a_crash():
    data = batches(12, seed=6)
    ref = model()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), data, reference=True)
    with tempfile.TemporaryDirectory(prefix="tierd-host-home-") as root:
        proc = start_daemon(root, "--device=none", "--probe_bytes=0")
        try:
            m = model()
            opt = offloaded(m, root, home="host", name="pytest/host-run", resume=False)
            losses = train(m, opt, data[:6])
            opt.close()
        finally:
            stop_daemon(proc, root)  # a clean stop writes the host-home state to NVMe
        proc = start_daemon(root, "--device=none", "--probe_bytes=0")
        try:
            m = model(seed=99)
            opt = offloaded(m, root, home="host", name="pytest/host-run", resume=True)
            try:
                assert opt.resumed and opt.steps_taken == 6
                losses += train(m, opt, data[6:9])  # written since: only in memory now
            finally:
                opt.close()
        finally:
            proc.kill()  # a crash: its sockets stay behind
            proc.wait()
            for name in ("tierd.sock", "tierd.session.sock"):
                os.unlink(os.path.join(root, name))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[:9]), rtol=1e-5,
                                   atol=0)
        proc = start_daemon(root, "--device=none", "--probe_bytes=0")
        try:
            with pytest.raises(tierd.TierdError) as lost:
                offloaded(model(), root, home="host", name="pytest/host-run", resume=True)
            assert lost.value.code_name == "DATA_LOSS"
            assert "was lost" in str(lost.value) and "reset" in str(lost.value)
            # Never silently a fresh start: create-or-open refuses too; reset starts afresh.
            with pytest.raises(tierd.TierdError) as again:
                offloaded(model(), root, home="host", name="pytest/host-run")
            assert again.value.code_name == "DATA_LOSS"
            opt = offloaded(model(), root, home="host", name="pytest/host-run", reset=True)
            assert not opt.resumed and opt.steps_taken == 0
            opt.close()
        finally:
            stop_daemon(proc, root)
        assert "was lost" in open(os.path.join(root, "daemon.log")).read()


def test_persistent_state_on_a_daemon_without_nvme_says_it_will_not_survive():
    with tempfile.TemporaryDirectory(prefix="tierd-no-nvme-") as root:
        # The later flag wins over start_daemon's region.
        proc = start_daemon(root, "--nvme_regions=none", "--device=none", "--probe_bytes=0")
        try:
            with pytest.warns(RuntimeWarning, match="no NVMe tier"):
                opt = offloaded(model(), root, name="pytest/volatile")
            opt.close()
        finally:
            stop_daemon(proc, root)
        text = open(os.path.join(root, "daemon.log")).read()
        assert "no NVMe tier" in text and "lost with this stop" in text, text


def test_the_example_trains_a_gpt_and_resumes_it(daemon):  # noqa: F811
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                           "train_gpt.py")
    small = ["--socket-dir", daemon, "--name", "pytest/gpt", "--layers", "1", "--d-model", "64",
             "--ctx", "32", "--steps", "10", "--warmup", "2"]

    def run(*extra):
        return subprocess.run([sys.executable, example, *small, *extra], capture_output=True,
                              text=True, timeout=240)

    first = run("--fresh")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "new state 'pytest/gpt'" in first.stdout and "at home on nvme" in first.stdout
    assert "saved at step 10" in first.stdout
    assert "tensors a step in tierd" in first.stdout  # activations offloaded too
    again = run()  # neither --resume nor --fresh: the existing state is not touched
    assert again.returncode == 2 and "--resume continues it" in again.stderr, again.stderr
    resumed = run("--resume", "--steps", "2")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed 'pytest/gpt' at step 10" in resumed.stdout
    assert "steps 11-12" in resumed.stdout
