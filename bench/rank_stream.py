"""A data-parallel job's ranks on one node streaming one set of weights (share_ranks=True) beside
each rank streaming its own copy: the daemon's host-tier bytes while they train, and the step.

For 1, 2 and 4 ranks (torchrun on this node, gloo) and each way on a fresh daemon: the example's
GPT (its blocks streamed, the optimizer sharded over the ranks, ZeRO-1), a few steps of the same
global batch; rank 0 reports the host tier's bytes (the most after a step: every rank's gradients
made), the median step and the losses. Then the gradients' sum alone: each rank's --reduce-mib of
fp32 gradients in the daemon's memory, each rank summing its shard of them from every rank's in
rank order (what share_ranks's owners do), beside gloo reducing the same bytes to each shard's
owner (what each rank with its own copy does) and gloo's all_reduce of them. Last, two nodes
(two daemons on this machine, a torchrun each) of --per-node ranks each way: the bytes the
ranks' gradients and new weights put through torch.distributed a step (share_ranks: only the node
sums and each node's new weights), each node's host tier and the step.

    python3 bench/rank_stream.py [--ranks 1,2,4] [--layers 8 --d-model 512] [--per-node 2]
"""
import argparse
import json
import os
import statistics
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--host-capacity", default="4GiB")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--share", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reduce-mib", type=int, default=64,
                    help="each rank's gradients for the sum's comparison (0: skip it)")
    ap.add_argument("--sum", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--per-node", type=int, default=2,
                    help="ranks on each of two nodes for the nodes' comparison (0: skip it)")
    args = ap.parse_args()
    os.environ.setdefault("TIERD_CLIENT_LIB",
                          os.path.join(args.build, "client", "libtierd_client.so.0"))
    return args


def rank(args):
    """One rank under torchrun."""
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from train_gpt import GPT
    import tierd.torch
    from tierd.client import Tier, connect
    os.environ["TIERD_JOB"] = "bench-rank-stream"
    dist.init_process_group("gloo")
    r, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    model = GPT(args.layers, args.d_model, 8, args.ctx)
    stream = tierd.torch.stream_parameters(
        model, device=torch.device("cpu"), device_budget_bytes=1 << 30, prefetch=1,
        name="bench/gpt" if args.share else f"bench/gpt-{r}", socket_dir=args.child,
        share_ranks=args.share)
    opt = tierd.torch.OffloadedAdamW(model.parameters(), lr=1e-3, socket_dir=args.child,
                                     overlap_backward=True, threads=1, home="host",
                                     name=f"bench/gpt-state-{args.share}", reset=True)
    probe = connect(args.child, "bench probe")
    host = 0  # the host tier's bytes, the most after a step (each rank's gradients made)
    g = torch.Generator().manual_seed(7)
    times, losses, moved = [], [], []
    for _ in range(args.steps):
        x = torch.randint(0, 256, (args.batch, args.ctx + 1), generator=g)
        xs = x.chunk(world)[r]
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(xs[:, :-1], xs[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        dist.barrier()
        host = max(host, probe.tier_usage(Tier.HOST).used_bytes)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        sent = torch.tensor(opt.last_stats["dist_bytes"], dtype=torch.float64)
        dist.all_reduce(sent)
        moved.append(float(sent))
    nodes = [None] * world  # each node's host tier (its daemon's socket directory)
    dist.all_gather_object(nodes, (args.child, host))
    if r == 0:
        with open(args.out, "w") as f:
            json.dump({"host_bytes": host, "step_s": statistics.median(times[1:]),
                       "losses": losses, "dist_bytes": statistics.median(moved[1:]),
                       "node_host_bytes": list(dict(nodes).values())}, f)
    probe.close()
    opt.close()
    stream.close()
    dist.destroy_process_group()


def reduce_rank(args):
    """One rank of --reduce: the gradient sum through the daemon's memory beside gloo's."""
    import torch
    import torch.distributed as dist
    from tierd.client import Access, Tier, connect
    os.environ["TIERD_JOB"] = "bench-reduce"
    dist.init_process_group("gloo")
    r, world = dist.get_rank(), dist.get_world_size()
    n = args.reduce_mib * (1 << 20) // 4  # fp32 elements a rank sums over
    shard = n // world
    c = connect(args.child, f"bench reduce {r}")
    if r == 0:  # one chunk a rank, in the job's base, as share_ranks's gradient chunks
        ids = c.open_base("ranks/bench-reduce", [n * 4] * world, [Tier.HOST] * world, b"bench",
                          job_writable=True).ids
        c.seal_base("ranks/bench-reduce")
    dist.barrier()
    if r != 0:
        ids = c.open_base("ranks/bench-reduce").ids
    held = c.acquire(ids, Tier.HOST, Access.WRITE)
    views = [torch.from_dlpack(held.dlpack(k, "float32", [n])) for k in range(world)]
    g = torch.Generator().manual_seed(r)
    mine = torch.randn(n, generator=g)
    views[r].copy_(mine)
    out = torch.empty(shard)
    lo = r * shard  # this rank's shard of the sum
    timings = {"shared memory": [], "gloo reduce": [], "gloo all_reduce": []}
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        out.copy_(views[0][lo:lo + shard])
        for k in range(1, world):
            out.add_(views[k][lo:lo + shard])
        dist.barrier()
        timings["shared memory"].append(time.perf_counter() - t0)
        buf = mine.clone()
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.reduce(buf[k * shard:(k + 1) * shard], dst=k, async_op=True)
                 for k in range(world)]
        for w in works:
            w.wait()
        dist.barrier()
        timings["gloo reduce"].append(time.perf_counter() - t0)
        buf = mine.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        dist.barrier()
        timings["gloo all_reduce"].append(time.perf_counter() - t0)
    expected = sum(torch.randn(n, generator=torch.Generator().manual_seed(k))[lo:lo + shard]
                   for k in range(world))
    ok = bool(torch.allclose(out, expected, rtol=1e-5, atol=1e-5))
    if r == 0:
        with open(args.out, "w") as f:
            json.dump({k: statistics.median(v) for k, v in timings.items()} | {"ok": ok}, f)
    del views
    dist.barrier()  # every rank done reading the others' chunks
    held.release()
    c.close()
    dist.destroy_process_group()


def child_args(args, sock, out, share):
    """This script as one rank: the daemon at `sock`, rank 0's report into `out`."""
    return [os.path.abspath(__file__), "--child", sock, "--out", out, "--layers",
            str(args.layers), "--d-model", str(args.d_model), "--ctx", str(args.ctx), "--batch",
            str(args.batch), "--steps", str(args.steps)] + (["--share"] if share else [])


def run(args, ranks, share, reduce=False):
    import benchlib
    with benchlib.daemon(args.build, host_capacity=args.host_capacity, nvme="4GiB") as sock:
        out = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, "-m", "tierd.torchrun", "--standalone", f"--nproc_per_node={ranks}",
               *child_args(args, sock, out, share)]
        if reduce:
            cmd += ["--sum", "--reduce-mib", str(args.reduce_mib)]
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit(r.stdout[-3000:] + r.stderr[-3000:])
        with open(out) as f:
            got = json.load(f)
        os.unlink(out)
        return got


def run_nodes(args, per_node, share):
    """The training on two nodes (two daemons, a torchrun each with one c10d rendezvous)."""
    import benchlib
    with benchlib.daemon(args.build, host_capacity=args.host_capacity, nvme="4GiB") as a, \
            benchlib.daemon(args.build, host_capacity=args.host_capacity, nvme="4GiB") as b:
        out = tempfile.mktemp(suffix=".json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for sock in (a, b):
            cmd = [sys.executable, "-m", "tierd.torchrun", "--nnodes=2",
                   f"--nproc_per_node={per_node}", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=bench-nodes",
                   "--max_restarts=0", *child_args(args, sock, out, share)]
            env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env=env))
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode != 0 for p in procs):
            sys.exit("\n".join(o[-3000:] for o in outs))
        with open(out) as f:
            got = json.load(f)
        os.unlink(out)
        return got


def main():
    args = arguments()
    if args.child is not None:
        return reduce_rank(args) if args.sum else rank(args)
    mib = 1 << 20
    rows = []
    for ranks in [int(x) for x in args.ranks.split(",")]:
        own = run(args, ranks, False)
        one = run(args, ranks, True)
        rows.append((ranks, own, one))
        print(json.dumps({"ranks": ranks, "own": own, "shared": one}))
    print(f"GPT of {args.layers} blocks, d_model {args.d_model} (fp32), the batch of "
          f"{args.batch} sequences split over the ranks:")
    for ranks, own, one in rows:
        ratio = one["host_bytes"] / own["host_bytes"]
        print(f"  {ranks} rank(s): host tier  own copies {own['host_bytes'] / mib:7.1f} MiB   "
              f"shared {one['host_bytes'] / mib:7.1f} MiB  ({ratio:.2f} x)   median step  own "
              f"{own['step_s'] * 1e3:5.0f} ms   shared {one['step_s'] * 1e3:5.0f} ms  "
              f"({one['step_s'] / own['step_s']:.2f} x)   losses the same: "
              f"{own['losses'] == one['losses']}")
    if args.reduce_mib:
        print(f"Summing {args.reduce_mib} MiB of fp32 gradients a rank, each rank's shard of the "
              "sum (what ZeRO-1 needs), median of the steps:")
        for ranks in [int(x) for x in args.ranks.split(",") if int(x) > 1]:
            got = run(args, ranks, False, reduce=True)
            print(json.dumps({"ranks": ranks, "sum": got}))
            shm = got["shared memory"]
            red, allr = got["gloo reduce"], got["gloo all_reduce"]
            print(f"  {ranks} ranks: through the daemon's memory {shm * 1e3:6.1f} ms   gloo "
                  f"reduce to each shard's owner {red * 1e3:6.1f} ms ({red / shm:.1f} x)   gloo "
                  f"all_reduce {allr * 1e3:6.1f} ms ({allr / shm:.1f} x)   right: {got['ok']}")
    if args.per_node:
        own = run_nodes(args, args.per_node, False)
        one = run_nodes(args, args.per_node, True)
        print(json.dumps({"nodes": 2, "per_node": args.per_node, "own": own, "shared": one}))
        print(f"Two nodes of {args.per_node} ranks, a step (median), all ranks:")
        for what, got in (("own copies", own), ("shared   ", one)):
            print(f"  {what}: through torch.distributed {got['dist_bytes'] / mib:7.1f} MiB   "
                  "host tier " + " + ".join(f"{h / mib:.1f}" for h in got["node_host_bytes"]) +
                  f" MiB   step {got['step_s'] * 1e3:5.0f} ms")
        print(f"  shared / own: torch.distributed {one['dist_bytes'] / own['dist_bytes']:.2f} x"
              f"   host tier {sum(one['node_host_bytes']) / sum(own['node_host_bytes']):.2f} x"
              f"   step {one['step_s'] / own['step_s']:.2f} x   losses within 1e-4: "
              f"{all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(one['losses'], own['losses']))}")


if __name__ == "__main__":
    main()
