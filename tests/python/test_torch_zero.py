"""OffloadedAdamW sharded ZeRO-1 style over two ranks started by torchrun, each a session of one
daemon: the ranks' mean losses and the final weights equal torch.optim.AdamW trained in one
process on the whole of each batch, with buckets stepped during backward, with clipping that
triggers, a step one rank's inf makes every rank skip, and a frozen parameter and one without a
gradient on some steps left as torch leaves them; and the example trains on two ranks as it does
on one."""
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

from test_c_abi import daemon  # noqa: F401 (fixture)
from test_torch_optimizer import HYPER, batches, model, offloaded, train
from zero_rank import partial_forward

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
STEPS = 30


def torchrun(*args, timeout=300, ranks=2, check=True):
    """Ranks on this node (python3 -m tierd.torchrun: torchrun that also runs where torch
    1.13's own fails on Python 3.11). With check, their output; else the finished process.
    A rank killed by a signal prints every thread's Python stack (PYTHONFAULTHANDLER) into the
    output a failure shows. What torchrun and the ranks leave in a temporary directory goes
    with the run."""
    with tempfile.TemporaryDirectory(prefix="tierd-ranks-") as tmp:
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1",
                   PYTHONFAULTHANDLER="1", TMPDIR=tmp)
        r = subprocess.run([sys.executable, "-m", "tierd.torchrun", "--standalone",
                            f"--nproc_per_node={ranks}", *args], capture_output=True, text=True,
                           timeout=timeout, env=env)
    if not check:
        return r
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _one_process(daemon, got, options):  # noqa: F811
    """One process with the ranks' halves of each batch as its micro-batches, clipped by torch's
    clip_grad_norm_ and stepped by the same kernel unsharded (test_torch_optimizer compares that
    kernel with torch.optim.AdamW). The ranks began from other weights (seeds 0 and 1): the
    optimizer gave each bucket its owner's, on every rank; the reference begins from those."""
    ref = model(seed=0)
    differs = [not torch.equal(a, b) for a, b in zip(ref.parameters(), got["initial"])]
    assert any(differs) and not all(differs)
    with torch.no_grad():
        for p, initial in zip(ref.parameters(), got["initial"]):
            p.copy_(initial)
    if options.get("partial"):
        ref[0].requires_grad_(False)
        ref_opt = offloaded(ref, daemon, bucket_params=40_000, threads=1)  # as the ranks'
        ref_losses = []
        for step, (x, y) in enumerate(batches(STEPS, seed=6)):
            ref_opt.zero_grad(set_to_none=True)
            total = 0.0
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                loss = torch.nn.functional.cross_entropy(partial_forward(ref, xs, step), ys) / 2
                loss.backward()
                total += float(loss.detach())
            ref_opt.step()
            ref_losses.append(total)
        ref_opt.close()
        assert torch.equal(got["params"][0], got["initial"][0]), "the frozen embedding moved"
    else:
        ref_opt = offloaded(ref, daemon, bucket_params=40_000, threads=1)  # as the ranks'
        try:
            ref_losses = train(ref, ref_opt, batches(STEPS, seed=6), micro=2,
                               clip=options.get("clip"), poison=options.get("poison"),
                               reference=True)
        finally:
            ref_opt.close()
    return ref, ref_losses


@pytest.mark.parametrize("options", [
    dict(home="nvme", overlap=True),
    dict(home="host", overlap=True, clip=0.5, poison=9),
    dict(home="nvme", overlap=False, clip=0.5),
    dict(home="nvme", overlap=True, partial=True),
], ids=["overlap", "clip-and-skip", "at-step", "frozen-and-unused"])
def test_two_ranks_train_as_one_process_does(daemon, tmp_path, options):  # noqa: F811
    out = str(tmp_path / "ranks.pt")
    flags = ["--home", options["home"], "--steps", str(STEPS)]
    flags += ["--overlap"] if options["overlap"] else []
    flags += ["--clip", str(options["clip"])] if "clip" in options else []
    flags += ["--poison", str(options["poison"])] if "poison" in options else []
    flags += ["--partial"] if options.get("partial") else []
    torchrun(os.path.join(HERE, "zero_rank.py"), daemon, out, *flags)
    got = torch.load(out)

    # The reference computes as the ranks do, on one thread (torchrun's OMP_NUM_THREADS=1): a
    # matmul's sums are split by thread, so another thread count rounds otherwise.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref, ref_losses = _one_process(daemon, got, options)
    finally:
        torch.set_num_threads(threads)

    ranks = got["ranks"]
    assert [r["state_name"] for r in ranks] == ["pytest/zero.rank0of2", "pytest/zero.rank1of2"]
    # Each rank owns a share of the state and steps only it.
    owned = [set(r["owned"]) for r in ranks]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    stepped = set(range(len(list(ref.parameters()))))
    if options.get("partial"):
        stepped.discard(0)  # the frozen embedding: no state, as in torch
    assert owned[0] | owned[1] == stepped
    # The frozen embedding is given no bucket (no state, as in torch): one bucket fewer.
    assert ranks[0]["buckets"] + ranks[1]["buckets"] == (2 if options.get("partial") else 3)
    # With overlap, every bucket's gradients were on their way to its owner during backward
    # (whether the owner could step it then, before backward ended, is a matter of timing).
    expected = 3 if options["overlap"] else 0
    if options.get("partial"):
        # The last step's LayerNorm had no gradient: its bucket, first in bucket order, was
        # complete only at step(), and the reduces behind it waited for it.
        expected = 0
    assert [r["reduced_during_backward"] for r in ranks] == [expected] * 2
    skipped = 1 if "poison" in options else 0
    assert [r["skipped"] for r in ranks] == [skipped, skipped]
    assert [r["steps"] for r in ranks] == [STEPS - skipped] * 2
    if "clip" in options:
        assert max(n for n in ranks[0]["norms"] if n is not None and n == n and
                   n != float("inf")) > options["clip"]  # it clipped
        assert ranks[0]["norms"] == ranks[1]["norms"]  # one global norm

    # Both ranks' sessions were open together, each holding its share.
    clients = {s["client_name"]: s for s in got["status"]["session_list"]}
    for r in range(2):
        session = clients[f"optimizer pytest/zero.rank{r}of2"]
        assert session["chunks"] > 0 and session["bytes"] > 0 and session["job"] == "pytest-zero"

    # The same training as one process with the ranks' micro-batches, bit for bit: each
    # micro-batch's gradient there is half of a rank's (a power of two, exact), the two ranks'
    # sum is one addition either way, and the global norm is formed as clip_grad_norm_ forms it
    # from the same per-parameter norms.
    assert got["ranks"][0]["losses"] == ref_losses
    assert ref_losses[-1] < ref_losses[0] * 0.9
    for a, b in zip(ref.parameters(), got["params"]):
        assert torch.equal(b, a.detach())
    w = got["weights_of_ranks"]
    assert torch.equal(w[0], w[1]), "the ranks' weights differ"


def losses_of(stdout):
    """The example's losses, step by step, from its output (one rank's or torchrun's)."""
    return [float(m) for m in re.findall(r"^(?:\[\S+\]:)?step +\d+ +loss ([0-9.]+)", stdout, re.M)]


def assert_streamed_trains_as_in_memory(runs):
    """`runs`: streamed (True/False) -> (the example's output, what its --save wrote). The same
    losses, final weights and optimizer state, bit for bit."""
    text, saved = runs[True]
    assert "weights streamed: 3 blocks" in text, text
    assert losses_of(text) == losses_of(runs[False][0])
    for k, v in runs[False][1]["model"].items():
        assert torch.equal(saved["model"][k], v), k
    for k, v in runs[False][1]["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["optimizer"]["state"][k][key], v[key]), (k, key)


def test_the_example_trains_on_two_ranks_as_on_one(daemon):  # noqa: F811
    example = os.path.join(ROOT, "examples", "train_gpt.py")
    small = ["--socket-dir", daemon, "--layers", "1", "--d-model", "64", "--ctx", "32",
             "--steps", "8", "--warmup", "2", "--batch", "8", "--fresh"]
    one = subprocess.run([sys.executable, example, *small, "--name", "pytest/gpt-one"],
                         capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stdout + one.stderr
    two = torchrun(example, *small, "--name", "pytest/gpt-two")
    assert "2 ranks" in two, two
    assert "train_gpt: the loss did not fall" not in two
    one_losses, two_losses = losses_of(one.stdout), losses_of(two)
    assert len(one_losses) == len(two_losses) == 8, two
    torch.testing.assert_close(torch.tensor(two_losses), torch.tensor(one_losses), rtol=1e-4,
                               atol=0)


def test_two_ranks_each_streaming_their_model_train_as_two_ranks_in_memory(daemon, tmp_path):  # noqa: F811,E501
    """Each rank streams its own copy of the example's blocks; the optimizer's state is sharded
    over both (ZeRO-1) as without streaming: the same losses and final weights, bit for bit."""
    example = os.path.join(ROOT, "examples", "train_gpt.py")
    small = ["--socket-dir", daemon, "--layers", "3", "--d-model", "64", "--ctx", "32",
             "--steps", "6", "--warmup", "2", "--batch", "8", "--fresh", "--max-grad-norm", "1",
             "--activations", "memory"]
    runs = {}
    for streamed in (False, True):
        flags = ["--stream-parameters", "--prefetch", "0"] if streamed else []
        out = str(tmp_path / f"streamed-{streamed}.pt")
        runs[streamed] = (torchrun(example, *small, *flags, "--name", f"pytest/gpt-s{streamed}",
                                   "--save", out), torch.load(out))
    assert_streamed_trains_as_in_memory(runs)
