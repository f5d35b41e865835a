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
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from test_c_abi import start_daemon, stop_daemon
from test_torch_zero import assert_streamed_trains_as_in_memory, losses_of

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
SMALL = ["--layers", "3", "--d-model", "64", "--ctx", "32", "--steps", "6", "--warmup", "2",
         "--batch", "8", "--fresh", "--max-grad-norm", "1", "--activations", "memory"]


def two_nodes(tmp_path_factory):
    """Two daemons, as on two nodes: their socket directories. Each test's named optimizer state
    stays in them (as a job's does), hence a host tier of 64 MiB."""
    roots = [str(tmp_path_factory.mktemp(f"node{i}")) for i in range(2)]
    procs = [start_daemon(root, "--host_capacity=64MiB") for root in roots]
    yield roots
    for proc, root in zip(procs, roots):
        stop_daemon(proc, root)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    yield from two_nodes(tmp_path_factory)


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
