"""Checkpoints past one machine, on the two daemons of test_multinode.py (two nodes on this
machine): OffloadedAdamW's state saved by ranks on two nodes resumes resharded on another node and
on four ranks, each continued run equal to an uninterrupted one; a checkpoint round-trips bit for
bit in either format (torch's files or torch.distributed.checkpoint); and a checkpoint that is
missing a rank's file, is not what save_checkpoint writes, or would run code when loaded is
refused, the optimizer's state as it was.

Run by CTest with TIERD_BIN, TIERD_CLIENT_LIB and TIERCTL_BIN set.
"""
import collections
import json
import os
import pickle
import socket
import subprocess
import sys

import pytest
import torch

from test_multinode import EXAMPLE, HERE, SMALL, example_on_nodes, torchrun_nodes, two_nodes
from test_torch_optimizer import HYPER, batches, model, offloaded, train
from test_torch_zero import losses_of

import tierd  # noqa: E402 (the path test_c_abi sets)
import tierd.torch  # noqa: E402
from tierd.torch import _state_files  # noqa: E402


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    yield from two_nodes(tmp_path_factory)


ZERO = os.path.join(HERE, "zero_rank.py")


needs_dcp = pytest.mark.skipif("dcp" not in _state_files.formats(), reason=f"torch "
                               f"{torch.__version__} has no torch.distributed.checkpoint save "
                               "and load")
FORMATS = ["torch", pytest.param("dcp", marks=needs_dcp)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_checkpoint_of_two_nodes_resumes_on_another_node_and_on_four_ranks(nodes, tmp_path,
                                                                             fmt):
    """Saved by two ranks on two nodes, the state resumes resharded in a job of one rank on the
    other node and in one of four ranks (its buckets smaller, so that four can share them), and
    each continued run equals an uninterrupted one."""
    steps, flags = 6, ["--overlap", "--clip", "0.5"]
    ckpt, first = str(tmp_path / "ckpt"), str(tmp_path / "first.pt")
    codes, outs = torchrun_nodes(nodes, ZERO, "{socket_dir}", first, "--steps", str(steps),
                                 *flags, "--name", f"pytest/ckpt-{fmt}", "--save-checkpoint",
                                 ckpt, "--checkpoint-format", fmt)
    assert codes == [0, 0], "\n".join(outs)
    written = sorted(os.listdir(ckpt))
    if fmt == "torch":
        assert written == ["model.pt", "optimizer.rank0of2.pt", "optimizer.rank1of2.pt"]
    else:  # DCP's metadata and a data file per rank
        assert [f for f in written if not f.endswith(".distcp")] == [".metadata", "model.pt"]
        assert len([f for f in written if f.endswith(".distcp")]) == 2, written
    before = torch.load(first)

    def reference(world):
        """One process with each job's ranks' shares of a batch as its micro-batches, clipped
        by clip_grad_norm_, stepped by the same kernel unsharded; on one thread, as the ranks
        compute (a matmul's sums are split by thread)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _reference(world)
        finally:
            torch.set_num_threads(threads)

    def _reference(world):
        ref = model(seed=0)
        with torch.no_grad():
            for p, initial in zip(ref.parameters(), before["initial"]):
                p.copy_(initial)
        opt = offloaded(ref, nodes[0], threads=1)
        try:
            data = batches(2 * steps, seed=6)
            losses = train(ref, opt, data[:steps], micro=2, clip=0.5, reference=True)
            return ref, losses + train(ref, opt, data[steps:], micro=world, clip=0.5,
                                       reference=True)
        finally:
            opt.close()

    for world, where, bucket in ((1, [nodes[1]], 40_000), (4, [nodes[0]], 5_000)):
        ref, ref_losses = reference(world)
        out = str(tmp_path / f"resumed-{world}.pt")
        codes, outs = torchrun_nodes(where, ZERO, "{socket_dir}", out, "--steps", str(steps),
                                     "--skip", str(steps), *flags, "--name",
                                     f"pytest/ckpt-{fmt}-{world}", "--load-checkpoint", ckpt,
                                     "--bucket-params", str(bucket), nproc=world)
        assert codes == [0], "\n".join(outs)
        after = torch.load(out)
        assert len(after["ranks"]) == world
        assert [r["steps"] for r in after["ranks"]] == [2 * steps] * world  # resumed, not fresh
        got = before["ranks"][0]["losses"] + after["ranks"][0]["losses"]
        # Bit for bit up to the resumed job's first step: two ranks' sum is one addition, as
        # the micro-batches' (halves: exact), and the state resumed is the state saved.
        assert got[:steps + 1] == ref_losses[:steps + 1]
        if world < 4:
            assert got == ref_losses
            for a, b in zip(ref.parameters(), after["params"]):
                assert torch.equal(b, a.detach())
            continue
        # Four ranks' gradients are summed by gloo's reduce in an order of its own, not the
        # micro-batches' 0, 1, 2, 3: each element within a few ulps, which Adam's m / sqrt(v)
        # magnifies where v is near zero, for the last steps only.
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=0)
        for a, b in zip(ref.parameters(), after["params"]):
            torch.testing.assert_close(b, a.detach(), rtol=1e-4, atol=1e-4)


def test_the_example_checkpointed_on_two_nodes_goes_on_in_one_process(nodes, tmp_path):
    """The main job's own flags: --checkpoint on two nodes, --from-checkpoint in one process on
    the second node; steps 4-6 as one process that ran all six."""
    i = SMALL.index("--steps")
    small = SMALL[:i] + SMALL[i + 2:]
    ckpt = str(tmp_path / "ckpt")
    codes, outs = example_on_nodes(nodes, *small, "--steps", "3", "--name", "pytest/ex-two",
                                   "--checkpoint", ckpt)
    assert codes == [0, 0], "\n".join(outs)
    on = subprocess.run([sys.executable, EXAMPLE, "--socket-dir", nodes[1], *small, "--steps",
                         "3", "--name", "pytest/ex-on", "--from-checkpoint", ckpt],
                        capture_output=True, text=True, timeout=240)
    assert on.returncode == 0, on.stdout + on.stderr
    assert f"from {ckpt} at step 3" in on.stdout, on.stdout
    whole = subprocess.run([sys.executable, EXAMPLE, "--socket-dir", nodes[0], *small, "--steps",
                            "6", "--name", "pytest/ex-whole"],
                           capture_output=True, text=True, timeout=240)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    torch.testing.assert_close(torch.tensor(losses_of(on.stdout)),
                               torch.tensor(losses_of(whole.stdout)[3:]), rtol=1e-4, atol=0)


def test_resuming_state_this_node_does_not_have_says_to_load_the_checkpoint(nodes, tmp_path):
    # Rank 1 of a two-rank job ran on this node; the job comes back as one rank.
    tierd.torch.OffloadedAdamW(model().parameters(), **HYPER, socket_dir=nodes[1],
                               name="pytest/moved.rank1of2", reset=True).close()
    with pytest.raises(tierd.TierdError) as gone:
        tierd.torch.OffloadedAdamW(model().parameters(), **HYPER, socket_dir=nodes[1],
                                   name="pytest/moved", resume=True)
    why = str(gone.value)
    assert gone.value.code_name == "NOT_FOUND"
    assert "optimizer state 'pytest/moved' does not exist" in why
    assert "this daemon holds 'pytest/moved.rank1of2': the same job's state" in why  # made here
    assert f"the daemon on {socket.gethostname()} does not have it" in why
    assert "load_checkpoint(directory)" in why


def test_a_checkpoint_missing_a_ranks_file_is_refused_naming_it(nodes, tmp_path):
    opt = tierd.torch.OffloadedAdamW(model().parameters(), **HYPER, socket_dir=nodes[0])
    try:
        opt.save_checkpoint(str(tmp_path), format="torch")
        os.rename(tmp_path / "optimizer.rank0of1.pt", tmp_path / "optimizer.rank1of3.pt")
        with pytest.raises(FileNotFoundError) as missing:
            opt.load_checkpoint(str(tmp_path))
        assert "checkpoint of 3 ranks" in str(missing.value)
        assert "rank(s) 0, 2 are not there" in str(missing.value)
    finally:
        opt.close()


def stepped(socket_dir, name, m=None, steps=2):
    """An OffloadedAdamW that has taken `steps` steps on test_torch_optimizer's model, and the
    model."""
    m = m or model(seed=0)
    opt = tierd.torch.OffloadedAdamW(m.parameters(), **HYPER, socket_dir=socket_dir, name=name,
                                     reset=True)
    train(m, opt, batches(steps, seed=3))
    return opt, m


def assert_same_state(got, want):
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for index, entry in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entry)
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_checkpoint_in_one_process_round_trips_bit_for_bit(nodes, tmp_path, fmt):
    opt, m = stepped(nodes[0], f"pytest/one-{fmt}")
    try:
        opt.save_checkpoint(str(tmp_path), format=fmt)
        want = opt.state_dict()
    finally:
        opt.close()
    again = tierd.torch.OffloadedAdamW(m.parameters(), **HYPER, socket_dir=nodes[1],
                                       name=f"pytest/one-{fmt}", reset=True)
    try:
        again.load_checkpoint(str(tmp_path))
        assert_same_state(again.state_dict(), want)
    finally:
        again.close()


def test_the_default_format_is_dcp_where_torch_has_it_and_refused_where_not(nodes, tmp_path):
    opt, _ = stepped(nodes[0], "pytest/default-format")
    try:
        if "dcp" in _state_files.formats():
            opt.save_checkpoint(str(tmp_path / "default"))
            assert os.path.exists(tmp_path / "default" / ".metadata")
        else:
            opt.save_checkpoint(str(tmp_path / "default"))
            assert os.listdir(tmp_path / "default") == ["optimizer.rank0of1.pt"]
            with pytest.raises(ValueError) as old:
                opt.save_checkpoint(str(tmp_path / "dcp"), format="dcp")
            assert f"this is torch {torch.__version__}: use format='torch'" in str(old.value)
            # A DCP checkpoint (its metadata, say) brought to this torch is named as such.
            (tmp_path / "dcp").mkdir()
            (tmp_path / "dcp" / ".metadata").write_bytes(b"")
            with pytest.raises(ValueError) as unreadable:
                opt.load_checkpoint(str(tmp_path / "dcp"))
            assert "torch.distributed.checkpoint (DCP) checkpoint, which torch" in str(
                unreadable.value)
        with pytest.raises(ValueError) as neither:
            opt.save_checkpoint(str(tmp_path / "x"), format="safetensors")
        assert "'dcp' or 'torch'" in str(neither.value)
        # The two formats in one directory: which one was meant cannot be told.
        opt.save_checkpoint(str(tmp_path / "default"), format="torch")
        (tmp_path / "default" / ".metadata").touch()
        with pytest.raises(ValueError) as both:
            opt.load_checkpoint(str(tmp_path / "default"))
        assert "holds a checkpoint in both formats" in str(both.value)
    finally:
        opt.close()


@needs_dcp
def test_dcps_own_tools_read_the_checkpoint(nodes, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    opt, _ = stepped(nodes[0], "pytest/dcp-tools")
    try:
        opt.save_checkpoint(str(tmp_path / "ckpt"))
        want = opt.state_dict()
    finally:
        opt.close()
    dcp_to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    groups = json.loads(bytes(whole["optimizer.param_groups"].tolist()))
    assert groups == json.loads(json.dumps(want["param_groups"]))  # betas a list, as in JSON
    for index, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(whole[f"optimizer.state.{index}.{key}"], value)


@needs_dcp
def test_a_dcp_checkpoints_metadata_is_data_and_never_runs_code(nodes, tmp_path):
    marker = tmp_path / "ran"
    opt, _ = stepped(nodes[0], "pytest/dcp-pickle")
    try:
        opt.save_checkpoint(str(tmp_path / "ckpt"))
        with open(tmp_path / "ckpt" / ".metadata", "wb") as f:
            pickle.dump(_Runs(f"touch {marker}"), f)
        with pytest.raises(pickle.UnpicklingError) as refused:
            opt.load_checkpoint(str(tmp_path / "ckpt"))
        assert "may not name posix.system" in str(refused.value)
        assert not marker.exists()
        # getattr, which an enum member's pickle uses, reaches enum members only.
        with open(tmp_path / "ckpt" / ".metadata", "wb") as f:
            pickle.dump(_Takes(collections.OrderedDict, "fromkeys"), f)
        with pytest.raises(pickle.UnpicklingError) as refused:
            opt.load_checkpoint(str(tmp_path / "ckpt"))
        assert "may not take 'fromkeys'" in str(refused.value)
    finally:
        opt.close()


@needs_dcp
@pytest.mark.parametrize("planted, why", [
    ({"optimizer.state.0.exp_avg": "not a tensor"}, "entry optimizer.state.0.exp_avg is not a "
     "tensor in the checkpoint"),
    ({"optimizer.state.0.exp_avg_sq": torch.zeros(64, 96, dtype=torch.int32)}, "entry "
     "optimizer.state.0.exp_avg_sq is of torch.int32, not a floating point type"),
    ({"optimizer.state.0.exp_avg": torch.zeros(3)}, "entry optimizer.state.0.exp_avg of shape "
     "(3,) for a parameter of shape"),
    ({"optimizer.state.0.step": torch.zeros(2)}, "is not a step count"),
    ({"optimizer.param_groups": torch.zeros(2, 2, dtype=torch.uint8)}, "is not a JSON text"),
    ({"optimizer.meta": torch.tensor(list(b'{"format": 9}'), dtype=torch.uint8)},
     "an OffloadedAdamW of another format"),
    ({"optimizer.param_groups": torch.tensor(list(b'{"lr": 1'), dtype=torch.uint8)},
     "entry optimizer.param_groups is not a JSON text"),
    ({"optimizer.param_groups": torch.tensor(list(b'[1, 2]'), dtype=torch.uint8)},
     "entry optimizer.param_groups is not a list of groups"),
])
def test_a_dcp_checkpoint_that_is_not_what_it_should_be_is_refused(nodes, tmp_path, planted,
                                                                   why):
    """Entries read from a checkpoint DCP wrote but not as save_checkpoint does: refused before
    anything is loaded, and the optimizer's state is as it was."""
    import torch.distributed.checkpoint as dcp
    opt, _ = stepped(nodes[0], "pytest/dcp-planted")
    try:
        opt.save_checkpoint(str(tmp_path / "good"))
        before = opt.state_dict()
        flat = {}
        for key, md in dcp.FileSystemReader(
                str(tmp_path / "good")).read_metadata().state_dict_metadata.items():
            flat[key] = torch.empty(md.size, dtype=md.properties.dtype)
        dcp.load(flat, storage_reader=dcp.FileSystemReader(str(tmp_path / "good")))
        flat.update(planted)
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(tmp_path / "bad")))
        with pytest.raises(ValueError) as refused:
            opt.load_checkpoint(str(tmp_path / "bad"))
        assert why in str(refused.value)
        assert_same_state(opt.state_dict(), before)
    finally:
        opt.close()


class _Takes:
    """Pickles as getattr(owner, name)."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


class _Runs:
    """Pickled, it would run a command when loaded."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_checkpoint_file_is_data_and_never_runs_code(nodes, tmp_path):
    marker = tmp_path / "ran"
    torch.save({"format": 1, "rank": 0, "world": 1, "state": _Runs(f"touch {marker}")},
               tmp_path / "optimizer.rank0of1.pt")
    opt = tierd.torch.OffloadedAdamW(model().parameters(), **HYPER, socket_dir=nodes[0])
    try:
        with pytest.raises(pickle.UnpicklingError):
            opt.load_checkpoint(str(tmp_path))
        assert not marker.exists()
    finally:
        opt.close()
