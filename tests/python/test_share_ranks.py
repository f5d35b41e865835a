"""share_ranks: the ranks of a data-parallel job on one node (one daemon) streaming one set of
weights, started by torchrun, each a session of the daemon: the same training as each rank
streaming its own copy (bit for bit with two ranks; within the rounding of the sum's order with
four) and as one process taking the ranks' shares as micro-batches, with accumulation, clipping
and a skipped step, across a daemon restart; one base the job's ranks write, gone with the job; a
rank with another model or a rank killed mid-step ending the job at once and leaving nothing. Two
nodes of one and two ranks are in test_multinode.py."""
import os
import re
import subprocess
import time

import pytest
import torch

from test_c_abi import daemon, start_daemon, stop_daemon  # noqa: F401 (daemon: a fixture)
from test_torch_zero import losses_of, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_streaming_one_copy_train_as_ranks_streaming_a_copy_each(daemon, tmp_path, ranks):  # noqa: F811,E501
    """share_ranks: the ranks on the node stream one set of weights, each bucket's owner summing
    the ranks' gradients where they are and stepping it into the shared next version: the same
    losses, final weights and optimizer state as each rank streaming its own copy (clipping that
    triggers, buckets stepped during backward). Bit for bit with two ranks (a sum of two has one
    order); with four, the owner's sum ((g0 + g1) + g2) + g3 is not gloo's order, and Adam
    carries that rounding into the weights: within 1e-4 relative."""
    example = os.path.join(ROOT, "examples", "train_gpt.py")
    small = ["--socket-dir", daemon, "--layers", "3", "--d-model", "64", "--ctx", "32",
             "--steps", "6", "--warmup", "2", "--batch", "8", "--fresh", "--max-grad-norm", "0.5",
             "--activations", "memory", "--stream-parameters", "--prefetch", "0"]
    runs = {}
    for shared in (False, True):
        flags = ["--share-ranks"] if shared else []
        out = str(tmp_path / f"shared-{shared}.pt")
        runs[shared] = (torchrun(example, *small, *flags, "--name", f"pytest/gpt-r{ranks}{shared}",
                                 "--save", out, ranks=ranks), torch.load(out))
    assert f"{ranks} ranks" in runs[True][0]

    def same(a, b, what):
        if ranks == 2:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=what)
    same(torch.tensor(losses_of(runs[True][0])), torch.tensor(losses_of(runs[False][0])),
         "losses")
    for k, v in runs[False][1]["model"].items():
        same(runs[True][1]["model"][k], v, k)
    for k, v in runs[False][1]["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            same(runs[True][1]["optimizer"]["state"][k][key], v[key], (k, key))


def test_ranks_sharing_one_copy_accumulate_and_skip_as_ranks_with_a_copy_each(daemon, tmp_path):  # noqa: F811,E501
    """Two micro-batches a step, clipping, and a step one rank's inf makes every rank skip: one
    shared copy trains as a copy each, bit for bit."""
    script = os.path.join(HERE, "share_ranks_rank.py")
    got = {}
    for own in (True, False):
        out = str(tmp_path / f"own-{own}.pt")
        torchrun(script, daemon, out, "--steps", "5", "--accumulate", "2", "--poison-step", "2",
                 *(["--own"] if own else []), ranks=2)
        got[own] = torch.load(out)
    assert got[True]["skipped"] == got[False]["skipped"] == 1
    assert got[True]["losses"] == got[False]["losses"]
    for k, v in got[True]["weights"].items():
        assert torch.equal(got[False]["weights"][k], v), k


def test_ranks_sharing_one_copy_train_as_one_process_with_their_micro_batches(daemon, tmp_path):  # noqa: F811,E501
    """Two ranks sharing one copy, each a half of the batch, and one process taking the two
    halves as two micro-batches a step, with clipping: bit for bit. The ranks' (g0 + g1) / 2 and
    the process's g0 / 2 + g1 / 2 are the same bits (halving is exact), and the clipping norm is
    formed from every rank's per-parameter norms as one process forms it."""
    script = os.path.join(HERE, "share_ranks_rank.py")
    ranks, one = str(tmp_path / "ranks.pt"), str(tmp_path / "one.pt")
    torchrun(script, daemon, ranks, "--steps", "4", ranks=2)
    torchrun(script, daemon, one, "--steps", "4", "--micro-batches", "2", ranks=1)
    got, want = torch.load(ranks), torch.load(one)
    assert got["losses"] == want["losses"]
    for k, v in want["weights"].items():
        assert torch.equal(got["weights"][k], v), k


def test_the_ranks_share_one_base_that_goes_with_the_job(daemon, tmp_path):  # noqa: F811
    script = os.path.join(HERE, "share_ranks_rank.py")
    out = str(tmp_path / "shared.pt")
    torchrun(script, daemon, out, ranks=2)
    got = torch.load(out)
    assert [b["name"] for b in got["bases"]] == ["ranks/pytest_shared-gpt"], got["bases"]
    base = got["bases"][0]
    assert base["job"] == "pytest-share-ranks" and len(base["holders"]) == 2
    blocks = sum(v.numel() * v.element_size() for k, v in got["weights"].items()
                 if k.startswith("blocks."))
    # Two versions and each rank's gradients, once a node.
    assert 4 * blocks <= base["bytes"] < 4 * blocks + (64 << 10)
    assert base["host_bytes"] == base["bytes"]
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    listed = subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={daemon}", "--json",
                             "bases"], check=True, capture_output=True, text=True).stdout
    assert listed.strip() == "[]"  # gone with the job's last session


def test_a_rank_with_another_model_makes_every_rank_fail_naming_it(daemon, tmp_path):  # noqa: F811
    script = os.path.join(HERE, "share_ranks_rank.py")
    r = torchrun(script, daemon, str(tmp_path / "x.pt"), "--layers-of-rank", "1:2", ranks=2,
                 check=False)
    assert r.returncode != 0
    text = r.stdout + r.stderr
    assert "another model's layout" in text, text
    assert "rank 1 on" in text, text  # rank 0's error names it
    listed = subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={daemon}", "--json",
                             "bases"], check=True, capture_output=True, text=True).stdout
    assert listed.strip() == "[]"


def test_a_rank_killed_mid_step_fails_the_job_in_seconds_and_leaves_nothing(daemon, tmp_path):  # noqa: F811,E501
    script = os.path.join(HERE, "share_ranks_rank.py")
    started = time.monotonic()
    r = torchrun(script, daemon, str(tmp_path / "x.pt"), "--die-at-step", "2", "--steps", "6",
                 ranks=2, check=False)
    assert r.returncode != 0
    assert time.monotonic() - started < 60
    text = r.stdout + r.stderr
    assert re.search(r"rank\s*:\s*1", text) or "rank 1" in text, text
    listed = subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={daemon}", "--json",
                             "bases"], check=True, capture_output=True, text=True).stdout
    assert listed.strip() == "[]"


def test_ranks_sharing_one_copy_resume_after_a_daemon_restart_as_a_copy_each(tmp_path):
    """share_ranks across a daemon restart: three steps and a checkpoint, the daemon stopped and
    started again (the ranks' base is gone with it), three more steps from the checkpoint, with
    the base made again: bit for bit as the same run with a copy each."""
    example = os.path.join(ROOT, "examples", "train_gpt.py")
    root = str(tmp_path / "node")
    os.mkdir(root)
    small = ["--socket-dir", root, "--layers", "3", "--d-model", "64", "--ctx", "32",
             "--warmup", "2", "--batch", "8", "--max-grad-norm", "0.5", "--activations",
             "memory", "--stream-parameters", "--prefetch", "0"]
    got = {}
    for shared in (False, True):
        flags = ["--share-ranks"] if shared else []
        name = f"pytest/restart-{shared}"
        ckpt, out = str(tmp_path / f"ckpt-{shared}"), str(tmp_path / f"out-{shared}.pt")
        proc = start_daemon(root)
        try:
            torchrun(example, *small, *flags, "--steps", "3", "--fresh", "--name", name,
                     "--checkpoint", ckpt)
        finally:
            stop_daemon(proc, root)
        proc = start_daemon(root)
        try:
            text = torchrun(example, *small, *flags, "--steps", "3", "--fresh", "--name", name,
                            "--from-checkpoint", ckpt, "--save", out)
        finally:
            stop_daemon(proc, root)
        got[shared] = (losses_of(text), torch.load(out))
    assert got[True][0] == got[False][0] and len(got[True][0]) == 3
    for k, v in got[False][1]["model"].items():
        assert torch.equal(got[True][1]["model"][k], v), k
