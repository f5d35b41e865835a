"""Past one machine: two nodes, stood in for by two daemons on this machine (each with its own
socket directory, state directory, NVMe region file and metrics port), and the example GPT started
on them by torchrun --nnodes=2 --nproc_per_node=1 with c10d rendezvous on 127.0.0.1 (gloo), each
node's rank talking to its own node's daemon through its own TIERD_SOCKET_DIR.

OffloadedAdamW sharded over the two nodes (with clipping, and buckets stepped during backward)
trains as one process does; streaming the weights on both nodes changes nothing, bit for bit; and
a rank whose node has no daemon fails at once, naming the node and the fix, with the other rank
stopping too instead of waiting in a collective.

Run by CTest with TIERD_BIN, TIERD_CLIENT_LIB and TIERCTL_BIN set.
"""
import collections
import json
import os
import pickle
import re
import socket
import subprocess
import sys

import pytest
import torch

from test_c_abi import start_daemon, stop_daemon
from test_torch_optimizer import HYPER, batches, model, offloaded, train
from test_torch_zero import assert_streamed_trains_as_in_memory, losses_of

import tierd  # noqa: E402 (the path test_c_abi sets)
import tierd.torch  # noqa: E402
from tierd.torch import _state_files  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
SMALL = ["--layers", "3", "--d-model", "64", "--ctx", "32", "--steps", "6", "--warmup", "2",
         "--batch", "8", "--fresh", "--max-grad-norm", "1", "--activations", "memory"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two daemons, as on two nodes: their socket directories. Each test's named optimizer state
    stays in them (as a job's does), hence a host tier of 64 MiB."""
    roots = [str(tmp_path_factory.mktemp(f"node{i}")) for i in range(2)]
    procs = [start_daemon(root, "--host_capacity=64MiB") for root in roots]
    yield roots
    for proc, root in zip(procs, roots):
        stop_daemon(proc, root)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(socket_dir, **more):
    """A node's environment; what its torchrun and ranks leave in a temporary directory goes
    with the node's socket directory."""
    return dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1",
                TIERD_SOCKET_DIR=socket_dir, PYTHONFAULTHANDLER="1", TMPDIR=socket_dir, **more)


def run_nodes(commands, envs, timeout=300):
    """The nodes' commands, all at once as a scheduler starts them; each one's exit status and
    output."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=e) for c, e in zip(commands, envs)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs


def torchrun_nodes(socket_dirs, script, *args, nproc=1, timeout=300):
    """`script` on `nproc` ranks per node (or a list: each node's), each node's torchrun with the
    same c10d rendezvous and the node's own TIERD_SOCKET_DIR ("{socket_dir}" in `args` too)."""
    port = free_port()
    per_node = nproc if isinstance(nproc, list) else [nproc] * len(socket_dirs)
    commands = [[sys.executable, "-m", "tierd.torchrun", f"--nnodes={len(socket_dirs)}",
                 f"--nproc_per_node={n}", "--rdzv_backend=c10d",
                 f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=pytest-nodes",
                 "--max_restarts=0", script, *(a.replace("{socket_dir}", d) for a in args)]
                for d, n in zip(socket_dirs, per_node)]
    return run_nodes(commands, [node_env(d) for d in socket_dirs], timeout)


def example_on_nodes(socket_dirs, *args, timeout=300, nproc=1):
    return torchrun_nodes(socket_dirs, EXAMPLE, "--socket-dir", "{socket_dir}", *args,
                          timeout=timeout, nproc=nproc)


def state_chunks(socket_dir, name):
    out = subprocess.run([os.environ["TIERCTL_BIN"], f"--socket_dir={socket_dir}", "--json",
                          "chunks", f"--name={name}"], check=True, capture_output=True, text=True)
    return [c["name"] for c in json.loads(out.stdout)]


def test_two_nodes_train_the_example_as_one_process_does(nodes, tmp_path):
    one = subprocess.run([sys.executable, EXAMPLE, "--socket-dir", nodes[0], *SMALL, "--name",
                          "pytest/nodes-one", "--save", str(tmp_path / "one.pt")],
                         capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stdout + one.stderr
    codes, outs = example_on_nodes(nodes, *SMALL, "--name", "pytest/nodes-two", "--save",
                                 str(tmp_path / "two.pt"))
    assert codes == [0, 0], "\n".join(outs)
    text = "".join(outs)
    assert "2 ranks" in text, text
    torch.testing.assert_close(torch.tensor(losses_of(text)), torch.tensor(losses_of(one.stdout)),
                               rtol=1e-4, atol=0)
    saved_one, saved_two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for k, v in saved_one["model"].items():
        torch.testing.assert_close(saved_two["model"][k], v, rtol=1e-4, atol=1e-5)
    # Each node's daemon holds its own rank's share of the state, and only that.
    for socket_dir in nodes:
        held = state_chunks(socket_dir, "pytest/nodes-two")
        ranks = {re.search(r"rank\dof2", n).group(0) for n in held}
        assert len(ranks) == 1, held
    assert ({re.search(r"rank\dof2", state_chunks(d, "pytest/nodes-two")[0]).group(0)
             for d in nodes} == {"rank0of2", "rank1of2"})


def test_two_nodes_streaming_their_weights_train_as_without(nodes, tmp_path):
    runs = {}
    for streamed in (False, True):
        flags = ["--stream-parameters", "--prefetch", "0"] if streamed else []
        out = tmp_path / f"streamed-{streamed}.pt"
        codes, outs = example_on_nodes(nodes, *SMALL, *flags, "--name",
                                     f"pytest/nodes-s{streamed}", "--save", str(out))
        assert codes == [0, 0], "\n".join(outs)
        runs[streamed] = ("".join(outs), torch.load(out))
    assert_streamed_trains_as_in_memory(runs)


@pytest.mark.parametrize("per_node", [1, 2])
def test_ranks_sharing_their_nodes_copy_train_as_a_copy_each(nodes, tmp_path, per_node):
    """share_ranks on two nodes of one and of two ranks: each node's ranks stream their node's
    one copy, its gradients summed on the node and only the node sums travel between nodes, and
    the new weights to each node once: the same training as each rank streaming its own copy,
    within the rounding of the sum's order ((g0 + g1) + (g2 + g3) against gloo's over four), and
    with two ranks a node half the streamed weights' bytes through torch.distributed."""
    runs = {}
    for shared in (False, True):
        flags = ["--share-ranks"] if shared else []
        out = tmp_path / f"shared-{shared}.pt"
        codes, outs = example_on_nodes(nodes, *SMALL, "--stream-parameters", "--prefetch", "0",
                                       *flags, "--name", f"pytest/nodes-share{shared}", "--save",
                                       str(out), nproc=per_node)
        assert codes == [0, 0], "\n".join(outs)
        runs[shared] = ("".join(outs), torch.load(out))
    world, count = 2 * per_node, 2
    assert f"{world} ranks" in runs[True][0]
    torch.testing.assert_close(torch.tensor(losses_of(runs[True][0])),
                               torch.tensor(losses_of(runs[False][0])), rtol=1e-4, atol=0)
    for k, v in runs[False][1]["model"].items():
        torch.testing.assert_close(runs[True][1]["model"][k], v, rtol=1e-4, atol=1e-5, msg=k)
    # Through torch.distributed a step, all ranks: each rank's gradients and new weights of
    # every parameter (a reduce and a broadcast each), against every rank's of the resident
    # ones and each node's once of the streamed ones.
    model = runs[False][1]["model"]
    streamed = sum(v.numel() * v.element_size() for k, v in model.items()
                   if k.startswith("blocks."))
    resident = sum(v.numel() * v.element_size() for k, v in model.items()) - streamed
    moved = {shared: [float(m) for m in re.findall(r"torch\.distributed (\S+) MiB", text)]
             for shared, (text, _) in runs.items()}
    assert len(moved[True]) == len(moved[False]) == 6, moved
    for mib in moved[False]:
        assert mib * 2**20 == pytest.approx(2 * world * (resident + streamed), rel=0.01)
    for mib in moved[True]:
        assert mib * 2**20 == pytest.approx(2 * world * resident + 2 * count * streamed,
                                            rel=0.01)


def test_sharing_on_nodes_of_unequal_ranks_is_refused_on_every_rank(nodes, tmp_path):
    codes, outs = example_on_nodes(nodes, *SMALL, "--batch", "6", "--stream-parameters",
                                   "--share-ranks", "--name", "pytest/nodes-uneven",
                                   nproc=[2, 1], timeout=120)
    assert codes[0] != 0 and codes[1] != 0, "\n".join(outs)
    for out in outs:
        assert "share_ranks on several nodes needs as many ranks on every node" in out, out
        assert re.search(r"here 2 on \S+:\S+node0\S*, 1 on \S+:\S+node1", out), out


def test_a_rank_on_a_node_without_a_daemon_fails_at_once_and_the_other_stops(nodes, tmp_path):
    empty = str(tmp_path / "no-daemon")
    os.mkdir(empty)
    codes, outs = example_on_nodes([nodes[0], empty], *SMALL, "--name", "pytest/nodes-missing",
                                 timeout=120)
    assert codes[0] != 0 and codes[1] != 0, "\n".join(outs)
    host = socket.gethostname()
    # The rank without a daemon says where and what to do; the other names it.
    assert f"cannot reach tierd on {host} at {empty}" in outs[1], outs[1]
    assert "systemctl start tierd" in outs[1], outs[1]
    assert re.search(rf"rank \d on {re.escape(host)}: .*cannot reach tierd on {re.escape(host)} "
                     rf"at {re.escape(empty)}", outs[0]), outs[0]


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


SLURM = os.path.join(ROOT, "deploy", "slurm")


def slurm_env(socket_dir, port):
    """What Slurm and train.sbatch give torchrun-node.sh on a node of a two-node job (torch
    1.13's torchrun fails on Python 3.11: its repaired launcher instead)."""
    return node_env(socket_dir, SLURM_NNODES="2", SLURM_JOB_ID="4242", TIERD_RANKS_PER_NODE="1",
                    TIERD_RDZV_HOST="127.0.0.1", TIERD_RDZV_PORT=str(port),
                    TIERD_TORCHRUN=f"{sys.executable} -m tierd.torchrun")


def test_the_slurm_recipe_starts_the_ranks_of_every_node_against_its_daemon(nodes):
    port = free_port()
    command = [os.path.join(SLURM, "torchrun-node.sh"), EXAMPLE, *SMALL, "--name",
               "pytest/slurm"]
    codes, outs = run_nodes([command, command], [slurm_env(d, port) for d in nodes])
    assert codes == [0, 0], "\n".join(outs)
    assert "2 ranks" in "".join(outs)
    with open(os.path.join(SLURM, "train.sbatch")) as f:
        batch = f.read()
    subprocess.run(["bash", "-n", os.path.join(SLURM, "train.sbatch")], check=True)
    assert "#SBATCH --ntasks-per-node=1" in batch  # one torchrun per node
    assert re.search(r'^srun --kill-on-bad-exit=1 "\$here/torchrun-node.sh" "\$@"$', batch, re.M)


def test_the_slurm_recipe_refuses_a_node_without_its_daemon(tmp_path):
    empty = str(tmp_path)
    r = subprocess.run([os.path.join(SLURM, "torchrun-node.sh"), EXAMPLE],
                       env=slurm_env(empty, free_port()), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1
    assert f"no tierd on {socket.gethostname()} (no socket in {empty})" in r.stderr
    assert "systemctl start tierd" in r.stderr


def test_the_kubernetes_jobs_torchrun_arguments_run_on_two_nodes(nodes):
    """The training Job's command line, with what only a cluster has put in this machine's terms:
    the rendezvous host (pod 0's DNS name), one rank per node (no GPUs), the example's path."""
    import yaml
    with open(os.path.join(ROOT, "deploy", "kubernetes", "training-job.yaml")) as f:
        job = next(d for d in yaml.safe_load_all(f) if d["kind"] == "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["torchrun"]
    port = free_port()
    local = {"--nproc_per_node": "1", "--rdzv_endpoint": f"127.0.0.1:{port}",
             "--device": "cpu", "--name": "pytest/k8s"}
    args = []
    for a in container["args"]:
        key = a.split("=", 1)[0]
        if key in local:
            a = f"{key}={local[key]}"
        elif a.endswith("train_gpt.py"):
            a = EXAMPLE
        args.append(a)
    command = [sys.executable, "-m", "tierd.torchrun", *args, *SMALL]
    codes, outs = run_nodes([command, command], [node_env(d) for d in nodes])
    assert codes == [0, 0], "\n".join(outs)
    assert "2 ranks" in "".join(outs)


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
