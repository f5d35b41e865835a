#!/usr/bin/env python3
"""The training step of examples/train_gpt.py's model: tierd offload beside torch in memory.

One run, side by side on the same model, data and seed:
  tierd:  tierd.torch.OffloadedAdamW, state at home on NVMe, a host budget a quarter of the state,
          each bucket stepped during backward;
  torch:  torch.optim.AdamW (foreach), everything in the process's memory.
Blocks of steps alternate between the two so that drift of the machine hits both alike. Prints
the median step of each, their ratio, and the optimizer's tail after backward as a share of the
tierd step. Starts its own daemon (the build's, NVMe region in a temporary directory).

    bench/train_step.py [--build build] [--steps 24] [--layers 4 --d-model 192 --ctx 64 --batch 8]
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


def main():
    args = benchlib.arguments(__doc__.split("\n\n")[0], steps=24)
    import tierd.torch
    import train_gpt

    with benchlib.daemon(args.build, device=args.device) as root:
        device = torch.device(args.device)
        data = train_gpt.load_text()

        def make():
            torch.manual_seed(1)
            return train_gpt.GPT(args.layers, args.d_model, args.heads, args.ctx).to(device)

        m_tierd, m_torch = make(), make()
        params = sum(p.numel() for p in m_tierd.parameters())
        budget = max(12 * params // 4, 1 << 20)  # at least the three shards a window needs
        opt_tierd = tierd.torch.OffloadedAdamW(
            m_tierd.parameters(), lr=1e-3, weight_decay=0.1, home="nvme",
            host_budget_bytes=budget, overlap_backward=True,
            bucket_params=max(params // 16, 1 << 16), socket_dir=root)
        opt_torch = torch.optim.AdamW(m_torch.parameters(), lr=1e-3, weight_decay=0.1)
        runs = {"tierd": (m_tierd, opt_tierd, [], []), "torch": (m_torch, opt_torch, [], [])}

        class Shape:
            seed, ctx, batch = 1, args.ctx, args.batch

        while min(len(r[2]) for r in runs.values()) < args.steps + 1:
            for name, (model, opt, times, tails) in runs.items():
                for _ in range(args.block):
                    x, y = train_gpt.batch(data, len(times), Shape, device)  # same data
                    t0 = time.perf_counter()
                    model(x, y).backward()
                    t1 = time.perf_counter()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    times.append(t2 - t0)
                    tails.append(t2 - t1)
        opt_tierd.close()
        med = {n: statistics.median(r[2][1:]) for n, r in runs.items()}
        tail = {n: statistics.median(r[3][1:]) for n, r in runs.items()}
        print(f"train_step: {params / 1e6:.2f} M parameters, {args.batch}x{args.ctx} tokens, "
              f"{args.device}, torch {torch.__version__}, {torch.get_num_threads()} torch "
              f"thread(s); tierd state {12 * params / 2**20:.1f} MiB on NVMe through a "
              f"{budget / 2**20:.1f} MiB host budget; {args.steps} steps each after a warm-up")
        for n in runs:
            print(f"  {n:6s} median step {med[n] * 1e3:7.1f} ms   optimizer after backward "
                  f"{tail[n] * 1e3:6.1f} ms ({100 * tail[n] / med[n]:4.1f} % of the step)")
        print(f"  tierd / torch: {med['tierd'] / med['torch']:.3f}x")


if __name__ == "__main__":
    main()
