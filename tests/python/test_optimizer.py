"""The optimizer through the C ABI, against torch.optim (Debian's python3-torch) on the same inputs.

tierd_cpu_adam_step is compared with torch.optim.AdamW and torch.optim.Adam over several steps,
for fp32 and bf16 gradients with loss scaling; the out-of-core optimizer (state on NVMe through a
real daemon, a host budget smaller than the state) with AdamW over the same gradients.
"""
import ctypes

import pytest
import torch

from test_c_abi import OK, TIER_NVME, daemon, lib, load_library  # noqa: F401 (fixtures)
from tierd import _abi  # noqa: E402 (test_c_abi put python/ on the path)

FLOAT32, BFLOAT16 = 0, 1
DATA_LOSS, FAILED_PRECONDITION = 15, 9


# The structures as the package declares them, bound by its load_library (the `lib` fixture): a
# copy here once fell behind the header.
AdamHyper, AdamOptions, StepStats = _abi.AdamHyper, _abi.AdamOptions, _abi.AdamStepStats


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def assert_close(got, want, what):
    # fp32 evaluation of the same formula in another order: within 1e-6 relative, plus the size
    # of one rounding of the update for values that cancel towards zero.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_cpu_adam_step_matches_torch(lib, adamw, grad_dtype):
    torch.manual_seed(3)
    n = 100_003  # vector tails
    lr, betas, eps, wd, scale = 1e-2, (0.9, 0.999), 1e-8, 0.05, 128.0
    p0 = torch.randn(n)
    ref = p0.clone().requires_grad_(True)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    hyper = AdamHyper(lr, betas[0], betas[1], eps, wd, 1 if adamw else 0)
    for step in range(1, 4):
        g = (torch.randn(n) * scale).to(grad_dtype)
        ref.grad = g.float() / scale
        opt.step()
        assert lib.tierd_cpu_adam_step(ptr(p), ptr(m), ptr(v), ptr(g),
                                       BFLOAT16 if grad_dtype == torch.bfloat16 else FLOAT32,
                                       ptr(out), BFLOAT16, n, ctypes.byref(hyper), scale, step,
                                       0) == OK, lib.tierd_last_error()
        state = opt.state[ref]
        assert_close(p, ref.detach(), f"param, step {step}")
        assert_close(m, state["exp_avg"], f"exp_avg, step {step}")
        assert_close(v, state["exp_avg_sq"], f"exp_avg_sq, step {step}")
        assert torch.equal(out, p.to(torch.bfloat16))


def test_cpu_adam_step_rejects_bad_arguments(lib):
    x = torch.zeros(8)
    hyper = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    assert lib.tierd_cpu_adam_step(ptr(x), ptr(x), ptr(x), ptr(x), 7, None, 0, 8,
                                   ctypes.byref(hyper), 1.0, 1, 0) == 3
    assert b"grad_dtype" in lib.tierd_last_error()
    assert lib.tierd_cpu_adam_step(ptr(x), ptr(x), ptr(x), ptr(x), FLOAT32, None, 0, 8,
                                   ctypes.byref(hyper), 1.0, 0, 0) == 3
    assert torch.equal(x, torch.zeros(8))


def test_offloaded_adam_matches_torch_adamw(lib, daemon):
    torch.manual_seed(5)
    sizes = [300_001, 200_000]  # 6 MB of state against a 2 MiB host budget
    names = (ctypes.c_char_p * 2)(b"w1", b"w2")
    params = (ctypes.c_uint64 * 2)(*sizes)
    options = AdamOptions()
    lib.tierd_adam_options_init(ctypes.byref(options))
    options.socket_dir = daemon.encode()
    options.name = b"pytest/adamw"
    options.home_tier = TIER_NVME
    options.reset = 1
    options.host_budget_bytes = 2 << 20
    options.hyper = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.01, 1)
    adam = ctypes.c_void_p()
    assert lib.tierd_adam_create(2, names, params, ctypes.byref(options),
                                 ctypes.byref(adam)) == OK, lib.tierd_last_error()
    try:
        assert lib.tierd_adam_resumed(adam) == 0
        weights = [torch.randn(n) for n in sizes]
        refs = [w.clone().requires_grad_(True) for w in weights]
        opt = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.01, foreach=True)
        for g, w in enumerate(weights):
            assert lib.tierd_adam_set_params(adam, g, ptr(w), w.numel()) == OK, \
                lib.tierd_last_error()
        for step in range(1, 4):
            grads = [torch.randn(n).to(torch.bfloat16) for n in sizes]
            outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
            for r, g in zip(refs, grads):
                r.grad = g.float()
            opt.step()
            assert lib.tierd_adam_begin_step(adam, 1.0) == OK, lib.tierd_last_error()
            for g in (1, 0):  # backward order
                assert lib.tierd_adam_step_group(adam, g, ptr(grads[g]), BFLOAT16, ptr(outs[g]),
                                                 BFLOAT16) == OK, lib.tierd_last_error()
            stats = StepStats()
            assert lib.tierd_adam_finish_step(adam, ctypes.byref(stats)) == OK, \
                lib.tierd_last_error()
            assert stats.step == step and stats.skipped_groups == 0
            for g, r in enumerate(refs):
                got = torch.empty(sizes[g])
                assert lib.tierd_adam_get_params(adam, g, ptr(got), sizes[g]) == OK
                assert_close(got, r.detach(), f"group {g}, step {step}")
                assert torch.equal(outs[g], got.to(torch.bfloat16))  # the copy for the GPU
        assert lib.tierd_adam_steps_taken(adam) == 3
        # Misuse: a step for a group that does not exist, and a finish without a begin.
        assert lib.tierd_adam_begin_step(adam, 1.0) == OK
        assert lib.tierd_adam_step_group(adam, 5, ptr(grads[0]), BFLOAT16, None, BFLOAT16) == 11
        assert lib.tierd_adam_finish_step(adam, None) == OK
        assert lib.tierd_adam_finish_step(adam, None) == FAILED_PRECONDITION
    finally:
        lib.tierd_adam_destroy(adam)
