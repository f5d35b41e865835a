"""One rank of test_torch_zero.py, started by torchrun: trains test_torch_optimizer's model on its
share of each global batch with OffloadedAdamW sharded over the ranks, and rank 0 saves the mean
loss of each step, the final weights and `tierctl status` while every rank's session was open.

    zero_rank.py SOCKET_DIR OUT [--home H] [--overlap] [--clip C] [--poison STEP] [--steps N]
                 [--partial] [--name NAME] [--save-checkpoint DIR] [--load-checkpoint DIR]
                 [--skip K] [--bucket-params N] [--checkpoint-format dcp|torch]

--partial: the embedding frozen and the LayerNorm used on even steps only (partial_forward), with
gradients set to None between steps: parameters without a gradient, as torch leaves them.
--save-checkpoint: after training, the optimizer's checkpoint and the model's weights (model.pt)
written to DIR. --load-checkpoint: the model's weights and the optimizer's state read from DIR
before training, which goes on from batch K (--skip), as a resumed job does. --checkpoint-format:
save_checkpoint's format (its default otherwise).
"""
import argparse
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_torch_optimizer import BUDGET, HYPER, batches, loss_of, model  # noqa: E402

import tierd.torch  # noqa: E402 (PYTHONPATH)


def partial_forward(m, x, step):
    """test_torch_optimizer's model with its LayerNorm (m[4]) on even steps only."""
    h = m[3](m[2](m[1](m[0](x))))
    return m[5](m[4](h) if step % 2 == 0 else h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("socket_dir")
    ap.add_argument("out")
    ap.add_argument("--home", default="nvme")
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--clip", type=float)
    ap.add_argument("--poison", type=int)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--partial", action="store_true")
    ap.add_argument("--name", default="pytest/zero")
    ap.add_argument("--save-checkpoint")
    ap.add_argument("--load-checkpoint")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--bucket-params", type=int, default=40_000)
    ap.add_argument("--checkpoint-format")
    ap.add_argument("--device-share", type=float)
    args = ap.parse_args()

    os.environ["TIERD_JOB"] = "pytest-zero"  # both ranks' sessions: one job
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = model(seed=rank)  # different on each rank: the optimizer starts them from its owners'
    if args.load_checkpoint:  # the weights first: the optimizer takes them as its master weights
        m.load_state_dict(torch.load(os.path.join(args.load_checkpoint, "model.pt")))
    if args.partial:
        m[0].requires_grad_(False)
    opt = tierd.torch.OffloadedAdamW(
        m.parameters(), **HYPER, socket_dir=args.socket_dir, host_budget_bytes=BUDGET, threads=1,
        home=args.home, name=args.name, reset=True, overlap_backward=args.overlap,
        max_grad_norm=args.clip, skip_nonfinite=args.poison is not None,
        bucket_params=args.bucket_params, device_share=args.device_share)
    if args.load_checkpoint:
        opt.load_checkpoint(args.load_checkpoint)
    initial = [p.detach().clone() for p in m.parameters()]  # the owners' weights, on every rank
    dist.barrier()
    status = None
    if rank == 0 and os.environ.get("TIERCTL_BIN"):
        status = json.loads(subprocess.run(
            [os.environ["TIERCTL_BIN"], f"--socket_dir={args.socket_dir}", "--json", "status"],
            check=True, capture_output=True, text=True).stdout)
    dist.barrier()

    losses, norms = [], []
    for step, (x, y) in enumerate(batches(args.skip + args.steps, seed=6)[args.skip:],
                                  start=args.skip):
        opt.zero_grad(set_to_none=args.partial)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        if args.partial:
            loss = torch.nn.functional.cross_entropy(partial_forward(m, xs, step), ys)
        else:
            loss = loss_of(m, xs, ys)
        mean = loss.detach().double()  # the ranks' sum exact: as the reference's micro-batches
        if args.poison == step and rank == 1:  # one rank's gradient is not finite
            loss = loss + next(iter(m.parameters()))[0, 0] * float("inf")
        loss.backward()
        opt.step()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        norms.append(opt.last_grad_norm)
    if args.save_checkpoint:
        opt.save_checkpoint(args.save_checkpoint, args.checkpoint_format)
        if rank == 0:
            torch.save(m.state_dict(), os.path.join(args.save_checkpoint, "model.pt"))
    shard = opt.state_dict()["state"]
    result = {"losses": losses, "norms": norms, "skipped": opt.skipped_steps,
              "steps": opt.steps_taken, "owned": sorted(shard), "state_name": opt.state_name,
              "buckets": opt.last_stats.get("buckets"),
              "stepped_during_backward": opt.last_stats.get("buckets_during_backward"),
              "reduced_during_backward": opt.last_stats.get("reduces_during_backward"),
              "device_params": opt.last_stats.get("device_params")}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    weights = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(weights, flat)
    if rank == 0:
        torch.save({"ranks": gathered, "status": status, "weights_of_ranks": weights,
                    "initial": initial,
                    "params": [p.detach().clone() for p in m.parameters()]}, args.out)
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
