#!/usr/bin/env python3
"""What activation offload costs per saved tensor: examples/train_gpt.py's model, forward and
backward (no optimizer), one run side by side:
  memory: saved tensors stay where autograd keeps them;
  copy:   saved_tensors_hooks that copy each tensor of at least min_bytes out (`.cpu()` on a GPU,
          a clone on the CPU) and hand it back: the plain way, no tierd;
  tierd-host, tierd-nvme: tierd.torch.offload_activations with every slab in host memory, and with
          a host budget a quarter of the saved bytes (the rest through NVMe and back).
Blocks of steps alternate between them; prints each one's median forward+backward and its cost
over `memory` per saved tensor it moved. Gradients of all four are checked equal first.

    bench/activation_offload.py [--build build] [--steps 16] [--layers 4 --d-model 192 ...]
"""
import contextlib
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

MIN_BYTES = 1 << 16


class CopyHooks:
    """The baseline: a copy out and back per saved tensor, in the process."""

    def __init__(self, device):
        self.device = device
        self.stored = 0

    def pack(self, t):
        if t.numel() * t.element_size() < MIN_BYTES or (t.is_leaf and t.requires_grad):
            return t
        self.stored += 1
        return t.to("cpu", non_blocking=True) if t.is_cuda else t.clone()

    def unpack(self, t):
        return t.to(self.device, non_blocking=True) if t.device != self.device else t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def main():
    args = benchlib.arguments(__doc__.split("\n\n")[0], steps=16)
    import tierd.torch
    import train_gpt

    device = torch.device(args.device)
    torch.manual_seed(1)
    model = train_gpt.GPT(args.layers, args.d_model, args.heads, args.ctx).to(device)
    data = train_gpt.load_text()

    class Shape:
        seed, ctx, batch = 1, args.ctx, args.batch

    def step(context, i):
        x, y = train_gpt.batch(data, i, Shape, device)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with context if context is not None else contextlib.nullcontext():
            loss = model(x, y)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, [p.grad.clone() for p in model.parameters()]

    with benchlib.daemon(args.build, host_capacity="1GiB", device=args.device) as root:
        # How many bytes a forward saves decides the NVMe run's budget.
        probe = tierd.torch.offload_activations(socket_dir=root, min_bytes=MIN_BYTES)
        step(probe, 0)
        saved_bytes = probe.stats.stored_bytes
        probe.close()
        runs = {
            "memory": None,
            "copy": CopyHooks(device),
            "tierd-host": tierd.torch.offload_activations(
                socket_dir=root, min_bytes=MIN_BYTES, host_budget_bytes=1 << 40),
            "tierd-nvme": tierd.torch.offload_activations(
                socket_dir=root, min_bytes=MIN_BYTES, host_budget_bytes=saved_bytes // 4),
        }
        reference = step(None, 0)[1]
        for name, context in runs.items():
            grads = step(context, 0)[1]
            assert all(torch.equal(a, b) for a, b in zip(reference, grads)), name
        times = {name: [] for name in runs}
        while min(len(t) for t in times.values()) < args.steps:
            for name, context in runs.items():
                for _ in range(args.block):
                    times[name].append(step(context, len(times[name]) + 1)[0])
        med = {n: statistics.median(t) for n, t in times.items()}
        per_step = {"copy": runs["copy"].stored / (len(times["copy"]) + 1)}
        for n in ("tierd-host", "tierd-nvme"):
            s = runs[n].stats
            per_step[n] = s.stored / (len(times[n]) + 1)
        nvme = runs["tierd-nvme"].stats
        print(f"activation_offload: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M "
              f"parameters, {args.batch}x{args.ctx} tokens, {args.device}, torch "
              f"{torch.__version__}, {torch.get_num_threads()} thread(s); a forward saves "
              f"{per_step['tierd-host']:.0f} tensors >= {MIN_BYTES >> 10} KiB "
              f"({saved_bytes / 2**20:.1f} MiB); tierd-nvme budget {saved_bytes / 4 / 2**20:.1f} "
              f"MiB, {nvme.nvme_written_bytes / (len(times['tierd-nvme']) + 1) / 2**20:.1f} MiB "
              f"a step to NVMe and back; gradients equal in all four; {args.steps} steps each")
        for n in runs:
            extra = ""
            if n != "memory":
                cost = (med[n] - med["memory"]) / per_step[n]
                extra = f"   {cost * 1e6:7.0f} us per saved tensor over memory"
            print(f"  {n:10s} median forward+backward {med[n] * 1e3:7.1f} ms{extra}")
        for n in ("tierd-host", "tierd-nvme"):
            runs[n].close()


if __name__ == "__main__":
    main()
