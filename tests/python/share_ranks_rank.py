"""One rank of test_share_ranks.py's cases, started by torchrun: the example's GPT
streamed with share_ranks=True (every rank on this node streams one set of weights) and trained
with OffloadedAdamW sharded over the ranks.

    share_ranks_rank.py SOCKET_DIR OUT [--layers-of-rank R:N] [--die-at-step K] [--steps N]
                        [--own] [--accumulate N] [--poison-step K] [--micro-batches N]

--layers-of-rank R:N: rank R builds N blocks (another model's layout: refused on every rank).
--die-at-step K: rank 1 kills itself (SIGKILL) in step K, after its backward.
--own: each rank streams its own copy instead (the reference).
--accumulate N: N micro-batches a step. --poison-step K: rank 1's loss is not finite in step K,
which every rank skips (skip_nonfinite). --micro-batches N: one process (a world of one) takes each
step's batch as N micro-batches, the shares N ranks take of it (the reference of N ranks).
Rank 0 writes the losses, the host tier's bytes while every rank streamed, and the bases the
daemon listed then, to OUT.
"""
import argparse
import json
import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
from train_gpt import GPT  # noqa: E402

import tierd.torch  # noqa: E402 (PYTHONPATH)
from tierd.client import Tier, connect  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("socket_dir")
    ap.add_argument("out")
    ap.add_argument("--layers-of-rank", default=None)
    ap.add_argument("--die-at-step", type=int, default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--own", action="store_true")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--poison-step", type=int, default=None)
    ap.add_argument("--micro-batches", type=int, default=None)
    args = ap.parse_args()
    os.environ["TIERD_JOB"] = "pytest-share-ranks"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = args.micro_batches or 1
    assert world == 1 or micro == 1, "--micro-batches stands for ranks: run it alone"
    shares = world * micro  # the batch's shares: the ranks', or one process's micro-batches
    layers = 3
    if args.layers_of_rank:
        r, n = (int(x) for x in args.layers_of_rank.split(":"))
        layers = n if r == rank else layers
    torch.manual_seed(1)
    model = GPT(layers, 64, 2, 32)
    stream = tierd.torch.stream_parameters(model, device=torch.device("cpu"),
                                           device_budget_bytes=8 << 20, prefetch=0,
                                           host_budget_bytes=None,
                                           name=f"pytest/own-gpt-{rank}" if args.own
                                           else "pytest/shared-gpt",
                                           socket_dir=args.socket_dir, share_ranks=not args.own)
    opt = tierd.torch.OffloadedAdamW(model.parameters(), lr=2e-3, socket_dir=args.socket_dir,
                                     overlap_backward=True, max_grad_norm=0.5, threads=1,
                                     accumulation_steps=args.accumulate * micro,
                                     skip_nonfinite=args.poison_step is not None,
                                     name=f"pytest/shared-gpt-state-{args.own}", reset=True)
    with connect(args.socket_dir, "probe") as c:
        host = c.tier_usage(Tier.HOST).used_bytes
    bases = json.loads(subprocess.run(
        [os.environ["TIERCTL_BIN"], f"--socket_dir={args.socket_dir}", "--json", "bases"],
        check=True, capture_output=True, text=True).stdout)
    g = torch.Generator().manual_seed(7)
    losses = []
    for step in range(args.steps):
        mean = torch.zeros(())
        for _ in range(args.accumulate):
            x = torch.randint(0, 256, (8, 33), generator=g)
            for k in range(micro):
                xs = x.chunk(shares)[rank * micro + k]
                loss = model(xs[:, :-1], xs[:, 1:]) / (args.accumulate * micro)
                mean += loss.detach()
                if args.poison_step == step and rank == 1:
                    loss = loss * float("inf")
                loss.backward()
        if args.die_at_step == step and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    if rank == 0:
        with stream.gathered():
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"losses": losses, "host_bytes": host, "bases": bases, "weights": weights,
                    "skipped": opt.skipped_steps}, args.out)
    opt.close()
    stream.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
