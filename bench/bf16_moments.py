#!/usr/bin/env python3
"""bf16 moments beside fp32: the example GPT's loss curve and the bytes a step moves.

One run, three optimizers on the same model, data and seed:
  torch:      torch.optim.AdamW, everything in memory (the fp32 reference);
  tierd-fp32: tierd.torch.OffloadedAdamW, fp32 exp_avg and exp_avg_sq;
  tierd-bf16: the same with state_dtype=torch.bfloat16.
Both tierd runs keep their state at home on NVMe behind the same host budget (a quarter of the
fp32 state) and step during backward. Blocks of steps alternate between the three. Prints the
loss of each, averaged over windows of steps, the NVMe bytes each tierd step moved and the median
step. Starts its own daemon (the build's, NVMe region in a temporary directory).

    bench/bf16_moments.py [--build build] [--steps 300] [--block 10] [--d-model 128 ...]
"""
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

LR, WARMUP, BETAS, DECAY = 2e-3, 10, (0.9, 0.95), 0.1  # examples/train_gpt.py's


def main():
    args = benchlib.arguments(__doc__.split("\n\n")[0], steps=300, d_model=128, block=10)
    window = 25
    import tierd
    import tierd.torch
    import train_gpt

    with benchlib.daemon(args.build, device=args.device) as root:
        device = torch.device(args.device)
        data = train_gpt.load_text()

        def make():
            torch.manual_seed(1)
            return train_gpt.GPT(args.layers, args.d_model, args.heads, args.ctx).to(device)

        models = {"torch": make(), "tierd-fp32": make(), "tierd-bf16": make()}
        params = sum(p.numel() for p in models["torch"].parameters())
        budget = max(12 * params // 4, 1 << 20)
        opts = {"torch": torch.optim.AdamW(models["torch"].parameters(), lr=LR, betas=BETAS,
                                           weight_decay=DECAY)}
        for name, dtype in (("tierd-fp32", torch.float32), ("tierd-bf16", torch.bfloat16)):
            opts[name] = tierd.torch.OffloadedAdamW(
                models[name].parameters(), lr=LR, betas=BETAS, weight_decay=DECAY, home="nvme",
                host_budget_bytes=budget, overlap_backward=True, state_dtype=dtype,
                bucket_params=max(params // 16, 1 << 16), socket_dir=root)
        client = tierd.connect(root, "bf16-moments bench")
        moved = lambda: client.path_bytes("nvme_to_host") + client.path_bytes("host_to_nvme")  # noqa: E731
        losses = {n: [] for n in models}
        times = {n: [] for n in models}
        traffic = {n: [] for n in models}

        class Shape:
            seed, ctx, batch = 1, args.ctx, args.batch

        while min(len(v) for v in losses.values()) < args.steps:
            for name, model in models.items():
                opt = opts[name]
                for _ in range(args.block):
                    step = len(losses[name]) + 1
                    if step > args.steps:
                        break
                    for g in opt.param_groups:
                        g["lr"] = LR * min(1.0, step / WARMUP)
                    x, y = train_gpt.batch(data, step, Shape, device)  # the same data
                    before = moved()
                    t0 = time.perf_counter()
                    loss = model(x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times[name].append(time.perf_counter() - t0)
                    traffic[name].append(moved() - before)
                    losses[name].append(loss.item())
        state = {n: opts[n].state_bytes for n in ("tierd-fp32", "tierd-bf16")}
        for n in state:
            opts[n].close()
        client.close()

    print(f"bf16_moments: {params / 1e6:.2f} M parameters, {args.batch}x{args.ctx} tokens a step, "
          f"{args.device}, torch {torch.__version__}; state at home on NVMe through a "
          f"{budget / 2**20:.1f} MiB host budget; {args.steps} steps each")
    for n in state:
        print(f"  {n}: state {state[n] / 2**20:.1f} MiB, NVMe traffic "
              f"{statistics.median(traffic[n][1:]) / 2**20:.1f} MiB a step (read + written), "
              f"median step {statistics.median(times[n][1:]) * 1e3:.0f} ms")
    print(f"  torch: median step {statistics.median(times['torch'][1:]) * 1e3:.0f} ms")
    print(f"  mean loss over each {window} steps (two fp32 runs that round differently drift apart "
          "as much as bf16 from fp32 does: the last column is that noise floor):")
    print("    steps      torch  tierd-fp32  tierd-bf16  bf16 - fp32  fp32 - torch")
    worst = {"bf16 against tierd-fp32": 0.0, "tierd-fp32 against torch": 0.0}
    for lo in range(0, args.steps, window):
        mean = {n: statistics.fmean(v[lo:lo + window]) for n, v in losses.items()}
        diff = mean["tierd-bf16"] - mean["tierd-fp32"]
        floor = mean["tierd-fp32"] - mean["torch"]
        worst["bf16 against tierd-fp32"] = max(worst["bf16 against tierd-fp32"],
                                               abs(diff) / mean["tierd-fp32"])
        worst["tierd-fp32 against torch"] = max(worst["tierd-fp32 against torch"],
                                                abs(floor) / mean["torch"])
        print(f"    {lo + 1:4d}-{min(lo + window, args.steps):<4d} {mean['torch']:7.4f}  "
              f"{mean['tierd-fp32']:10.4f}  {mean['tierd-bf16']:10.4f}  {diff:+11.4f}  "
              f"{floor:+12.4f}")
    last = max(1, args.steps // 3)
    print(f"  mean loss over the last {last} steps: " + ", ".join(
        f"{n} {statistics.fmean(v[-last:]):.4f}" for n, v in losses.items()))
    print("  largest window difference: " + "; ".join(
        f"{k} {100 * v:.2f} %" for k, v in worst.items()))

if __name__ == "__main__":
    main()
