#!/usr/bin/env python3
"""Parameter streaming (tierd.torch.stream_parameters) beside the same model in memory.

One run, the same model, data and seed, OffloadedAdamW (state at home on the host, each bucket
stepped during backward) in every variant:
  memory:       the model's weights on the device (the unlimited-memory ideal);
  stream-host:  its blocks streamed through a device budget of prefetch + 3 blocks, weights at
                home in the daemon's host tier;
  stream-nvme:  the same with the weights at home on NVMe.
Blocks of steps alternate between the variants so that drift of the machine hits all alike. Per
variant: the median step, its share of the ideal (memory / it), the bytes each link moved per
step beside that link's bound (bytes / the bandwidth probed in this run), the time compute
waited for weights, and the device peak. Then each variant again in a process of its own for
its peak RSS over three steps (anonymous and shared: the daemon's chunks mapped in) and the
daemon's host use.

--scale: one larger model instead (default 32 blocks of d 1280, about 0.63 B parameters, fp32),
weights and optimizer state at home on NVMe, through host and device budgets it is many times
larger than; a few steps, with the process's and the daemon's peak memory.

    bench/param_stream.py [--build build] [--steps 12] [--layers 12 --d-model 192 ...]
                          [--variants memory,stream-host] [--host-capacity 1GiB]
    bench/param_stream.py --scale [--layers 32 --d-model 1280 --steps 3]
                          [--device-share auto --device-budget BYTES --device-capacity 56GiB]
                          [--in-memory]
"""
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from tierd._sizes import size_text  # noqa: E402

VARIANTS = ("memory", "stream-host", "stream-nvme")


def reset_peak() -> None:
    """Starts the process's peak RSS (VmHWM) afresh from now: training's peak, not the model's
    construction in the process before it was streamed."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def setup(args, root, variant, device):
    """(model, optimizer, stream or None) of one variant."""
    import tierd.torch
    import train_gpt
    torch.manual_seed(1)
    model = train_gpt.GPT(args.layers, args.d_model, args.heads, args.ctx)
    if args.dtype != "float32":
        model = model.to(getattr(torch, args.dtype))
    stream = None
    if variant == "memory":
        model = model.to(device)
    else:
        block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        resident = sum(t.numel() * t.element_size() for t in
                       list(model.parameters()) + list(model.buffers())) - block * args.layers
        stream = tierd.torch.stream_parameters(
            model, device=device, device_budget_bytes=resident + (args.prefetch + 3) * block,
            prefetch=args.prefetch, socket_dir=root,
            host_budget_bytes=None if variant == "stream-host" else args.weights_host_budget)
    params = sum(p.numel() for p in model.parameters())
    opt = tierd.torch.OffloadedAdamW(
        model.parameters(), lr=args.lr, weight_decay=0.1, home=args.state_home,
        host_budget_bytes=args.state_host_budget, overlap_backward=True,
        bucket_params=max(params // 16, 1 << 16), socket_dir=root, name=None,
        device_share=args.device_share, device_budget_bytes=args.device_budget)
    return model, opt, stream


def node(args):
    """The daemon a run trains with: on the CPU an emulated device tier where the optimizer has
    a device share (its capacity --device-capacity, 1 GiB unless given); on a GPU its device tier
    of --device-capacity (the daemon's default unless given)."""
    emulated = (args.device_capacity or "1GiB") if args.device_share is not None else ""
    return benchlib.daemon(args.build, host_capacity=args.host_capacity, device=args.device,
                           emulated=emulated, device_capacity=args.device_capacity,
                           nvme=args.nvme_region)


def probe(root: str, device) -> dict:
    """Bandwidths (bytes/s) of the links, measured now: host -> device and device -> host (a copy
    of 64 MiB; on the CPU, memory to memory), NVMe -> host (256 MiB acquired back after an
    eviction)."""
    import tierd
    n = 64 << 20
    src = torch.empty(n, dtype=torch.uint8).pin_memory() if device.type == "cuda" else \
        torch.empty(n, dtype=torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    out = {}
    for name, (a, b) in (("h2d", (dst, src)), ("d2h", (src, dst))):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            a.copy_(b)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[name] = n / best
    with tierd.connect(root, "probe") as c:
        with c.allocate([64 << 20] * 4, tierd.Tier.NVME) as chunks:
            with c.acquire(chunks, tierd.Tier.HOST, tierd.Access.OVERWRITE) as a:
                a.ready.wait()
                for i in range(4):
                    a.memoryview(i)[:] = b"\1" * (64 << 20)
            c.evict(chunks, tierd.Tier.NVME).wait()
            t0 = time.perf_counter()
            with c.acquire(chunks, tierd.Tier.HOST, tierd.Access.READ) as a:
                a.ready.wait()
            out["nvme_read"] = (256 << 20) / (time.perf_counter() - t0)
    return out


def compare(args):
    import train_gpt
    device = torch.device(args.device)
    data = train_gpt.load_text()

    class Shape:
        seed, ctx, batch = 1, args.ctx, args.batch

    with node(args) as root:
        bw = probe(root, device)
        runs = {}
        for v in args.variants:
            model, opt, stream = setup(args, root, v, device)
            runs[v] = dict(model=model, opt=opt, stream=stream, times=[], losses=[], stats=[],
                           requests=[])
        while min(len(r["times"]) for r in runs.values()) < args.steps + 1:
            for v, r in runs.items():
                for _ in range(args.block):
                    step = len(r["times"])
                    x, y = train_gpt.batch(data, step, Shape, device)
                    before = r["stream"].stats if r["stream"] else None
                    asked = benchlib.requests(root)
                    t0 = time.perf_counter()
                    loss = r["model"](x, y)
                    loss.backward()
                    r["opt"].step()
                    r["opt"].zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    r["times"].append(time.perf_counter() - t0)
                    r["losses"].append(loss.item())
                    r.setdefault("lanes", []).append(dict(r["opt"].last_stats))
                    now = benchlib.requests(root)
                    r["requests"].append({op: n - asked.get(op, 0) for op, n in now.items()})
                    if before is not None:
                        after = r["stream"].stats
                        r["stats"].append({k: after[k] - before[k] for k in
                                           ("h2d_bytes", "d2h_bytes", "wait_s",
                                            "nvme_read_bytes")})
        n = min(len(r["losses"]) for r in runs.values())
        same = all(r["losses"][:n] == runs["memory"]["losses"][:n] for r in runs.values())
        model = runs["memory"]["model"]
        params = sum(p.numel() for p in model.parameters())
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"param_stream: {params / 1e6:.2f} M parameters ({model_bytes / 2**20:.1f} MiB of "
              f"{args.dtype} weights) in {args.layers} blocks, {args.batch}x{args.ctx} tokens, "
              f"{args.device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
              f"{args.steps} steps each after a warm-up; losses equal in every variant: {same}")
        print(f"  links probed: host->device {bw['h2d'] / 1e9:.2f} GB/s, device->host "
              f"{bw['d2h'] / 1e9:.2f} GB/s, NVMe->host {bw['nvme_read'] / 1e9:.2f} GB/s")
        ideal = statistics.median(runs["memory"]["times"][1:])
        for v, r in runs.items():
            med = statistics.median(r["times"][1:])
            tflops = benchlib.model_tflops(params, args.layers, args.d_model, args.ctx,
                                           args.batch * args.ctx, med)
            line = (f"  {v:12s} median step {med * 1e3:7.1f} ms  {ideal / med * 100:5.1f} % of "
                    f"the ideal ({med / ideal:.3f}x), {tflops:.2f} TFLOPS"
                    f"{benchlib.peak_share(tflops, device)}")
            # The daemon's requests in a step after the first (median by operation; the
            # schedule's cursor and version bits are stores into shared memory, not requests).
            ops = sorted({op for x in r["requests"][2:] for op in x})
            per = {op: statistics.median(x.get(op, 0) for x in r["requests"][2:]) for op in ops}
            line += (f"\n               daemon requests a step: {sum(per.values()):.0f} ("
                     + ", ".join(f"{op} {n:.0f}" for op, n in per.items() if n) + ")")
            if r["stream"] is not None:
                s = {k: statistics.median(x[k] for x in r["stats"][1:]) for k in r["stats"][0]}
                st = r["stream"].stats
                line += (f"\n               per step: weights in {s['h2d_bytes'] / 2**20:.1f} MiB "
                         f"(bound {s['h2d_bytes'] / bw['h2d'] * 1e3:.1f} ms), gradients out "
                         f"{s['d2h_bytes'] / 2**20:.1f} MiB (bound "
                         f"{s['d2h_bytes'] / bw['d2h'] * 1e3:.1f} ms), NVMe read "
                         f"{s['nvme_read_bytes'] / 2**20:.1f} MiB, the whole node (bound "
                         f"{s['nvme_read_bytes'] / bw['nvme_read'] * 1e3:.1f} ms); compute waited "
                         f"{s['wait_s'] * 1e3:.1f} ms\n               device peak "
                         f"{st['device_peak_bytes'] / 2**20:.2f} MiB of a "
                         f"{r['stream'].device_budget_bytes / 2**20:.2f} MiB budget "
                         f"({st['device_peak_bytes'] / model_bytes * 100:.0f} % of the model's "
                         f"weights); {st['on_demand']} fetches on demand, "
                         f"{st['trace_misses']} off the trace")
            lanes = r["lanes"][1:]
            if lanes and "device_params" in lanes[-1]:
                line += ("\n               optimizer lanes: device share "
                         f"{lanes[-1]['device_share']:.2f}, host busy "
                         f"{statistics.median(x['host_busy_s'] for x in lanes) * 1e3:.1f} ms, "
                         f"device busy "
                         f"{statistics.median(x['device_busy_s'] for x in lanes) * 1e3:.1f} ms, "
                         f"state kept on the device "
                         f"{size_text(lanes[-1]['device_kept_bytes'])}")
            print(line)
        for r in runs.values():
            r["opt"].close()
            if r["stream"] is not None:
                r["stream"].close()
    # Memory: each variant in a process of its own (peak RSS is per process).
    for v in args.variants:
        out = subprocess.run([sys.executable, __file__, "--memory-of", v, *ARGV],
                             capture_output=True, text=True, check=True).stdout
        m = json.loads(out.strip().splitlines()[-1])
        print(f"  {v:12s} process peak RSS in training {m['VmHWM'] / 2**20:6.1f} MiB (anonymous "
              f"{m['RssAnon'] / 2**20:6.1f}, daemon memory mapped {m['RssShmem'] / 2**20:6.1f}); "
              f"daemon host tier {m['host_used'] / 2**20:6.1f} MiB = "
              f"{m['host_used'] / m['params']:.1f} bytes a parameter")


def memory_of(args, variant):
    """One variant's process: a few steps, then its memory figures as one JSON line."""
    import train_gpt
    import tierd
    device = torch.device(args.device)
    data = train_gpt.load_text()

    class Shape:
        seed, ctx, batch = 1, args.ctx, args.batch

    with node(args) as root:
        model, opt, stream = setup(args, root, variant, device)
        reset_peak()
        for step in range(3):
            x, y = train_gpt.batch(data, step, Shape, device)
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with tierd.connect(root, "probe") as c:
            host = c.tier_usage(tierd.Tier.HOST).used_bytes
        m = benchlib.proc_status()
        m.update(host_used=host, params=sum(p.numel() for p in model.parameters()))
        opt.close()
        if stream is not None:
            stream.close()
    print(json.dumps(m))


def scale(args):
    """A model many times the host and device budgets, a few steps."""
    import train_gpt
    import tierd
    device = torch.device(args.device)
    data = train_gpt.load_text()

    class Shape:
        seed, ctx, batch = 1, args.ctx, args.batch

    with node(args) as root:
        t0 = time.perf_counter()
        model, opt, stream = setup(args, root, "memory" if args.in_memory else "stream-nvme",
                                   device)
        setup_s = time.perf_counter() - t0
        built = benchlib.proc_status()["VmHWM"]
        reset_peak()
        params = sum(p.numel() for p in model.parameters())
        weights = params * torch.finfo(getattr(torch, args.dtype)).bits // 8
        state = 12 * params
        where = "in the device's memory" if stream is None else (
            f"({stream.stats['units_on_nvme']} of {args.layers} blocks at home on NVMe)")
        print(f"param_stream --scale: {params / 1e9:.3f} B parameters: {weights / 2**30:.2f} GiB "
              f"of {args.dtype} weights {where}, {state / 2**30:.2f} GiB of optimizer state at "
              f"home on {'NVMe' if args.state_home == 'nvme' else 'the host'}; "
              + (f"the optimizer's host budget {args.state_host_budget / 2**20:.0f} MiB"
                 if stream is None else
                 f"device budget {stream.device_budget_bytes / 2**20:.0f} MiB "
                 f"({weights / stream.device_budget_bytes:.0f}x smaller than the weights), "
                 f"weights' host budget {args.weights_host_budget / 2**20:.0f} MiB and the "
                 f"optimizer's {args.state_host_budget / 2**20:.0f} MiB "
                 f"({(weights + state) / (args.weights_host_budget + args.state_host_budget):.0f}"
                 f"x smaller than weights and state)")
              + f"; set up in {setup_s:.0f} s")
        anon = 0  # the process's own memory (not the daemon's mapped in), after each phase
        for step in range(args.steps):
            x, y = train_gpt.batch(data, step, Shape, device)
            t0 = time.perf_counter()
            loss = model(x, y)
            anon = max(anon, benchlib.proc_status()["RssAnon"])
            loss.backward()
            anon = max(anon, benchlib.proc_status()["RssAnon"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            anon = max(anon, benchlib.proc_status()["RssAnon"])
            if device.type == "cuda":
                torch.cuda.synchronize()
            took = time.perf_counter() - t0
            tflops = benchlib.model_tflops(params, args.layers, args.d_model, args.ctx,
                                           args.batch * args.ctx, took)
            lanes = opt.last_stats
            print(f"  step {step + 1}: loss {loss.item():.4f}, {took:.2f} s, {tflops:.1f} TFLOPS"
                  f"{benchlib.peak_share(tflops, device)}"
                  + ("" if stream is None else
                     f"; device peak {stream.stats['device_peak_bytes'] / 2**20:.0f} MiB; "
                     f"compute waited {stream.stats['wait_s']:.1f} s in all")
                  + (f"; optimizer lanes: device share {lanes['device_share']:.2f}, host busy "
                     f"{lanes['host_busy_s']:.2f} s, device busy {lanes['device_busy_s']:.2f} s, "
                     f"state kept on the device {size_text(lanes['device_kept_bytes'])}"
                     if "device_params" in lanes else ""), flush=True)
        with tierd.connect(root, "probe") as c:
            host = c.tier_usage(tierd.Tier.HOST)
        m = benchlib.proc_status()
        print(f"  process peak RSS while training {m['VmHWM'] / 2**30:.2f} GiB, of which its own "
              f"(anonymous, the most after a forward, a backward or a step) "
              f"{anon / 2**30:.2f} GiB and the daemon's memory mapped in "
              f"{m['RssShmem'] / 2**30:.2f} GiB now (building the model in the process before "
              f"streaming it peaked at {built / 2**30:.2f} GiB); daemon peak RSS "
              f"{benchlib.daemon_peak_rss(root) / 2**30:.2f} GiB, its host tier "
              f"{host.used_bytes / 2**30:.2f} GiB in use of {host.capacity_bytes / 2**30:.2f}")
        opt.close()
        if stream is not None:
            stream.close()


ARGV = sys.argv[1:]


def main():
    memory_variant = None
    if "--memory-of" in sys.argv:
        k = sys.argv.index("--memory-of")
        memory_variant = sys.argv[k + 1]
        del sys.argv[k:k + 2]
    scaled = "--scale" in sys.argv
    steps = 3 if scaled else 12
    defaults = dict(layers=32, d_model=1280, heads=16, ctx=64, batch=1, prefetch=0) if scaled \
        else dict(layers=12, block=3)
    import argparse
    # No abbreviations: --device (benchlib's) would be taken for --device-share.
    extra = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    extra.add_argument("--scale", action="store_true")
    extra.add_argument("--prefetch", type=int, default=0 if scaled else 1)
    extra.add_argument("--dtype", default="float32")
    extra.add_argument("--lr", type=float, default=5e-5 if scaled else 1e-3)
    extra.add_argument("--weights-host-budget", type=int, default=(256 << 20) if scaled else 0)
    extra.add_argument("--state-host-budget", type=int, default=(512 << 20) if scaled else 64 << 20)
    extra.add_argument("--state-home", default="nvme" if scaled else "host")
    extra.add_argument("--host-capacity", default="6GiB" if scaled else "1GiB",
                       help="the daemon's host tier")
    extra.add_argument("--nvme-region", default="16GiB" if scaled else "1GiB")
    extra.add_argument("--device-share", default=None,
                       type=lambda s: s if s == "auto" else float(s),
                       help="OffloadedAdamW's device_share: the share of the parameters stepped "
                            "on the device (a number in [0, 1] or auto); default: all on the CPU")
    extra.add_argument("--device-budget", type=int, default=0,
                       help="OffloadedAdamW's device_budget_bytes: the device share's state kept "
                            "in the device tier between steps")
    extra.add_argument("--device-capacity", default="",
                       help="the daemon's device tier (default: the daemon's on a GPU, 1GiB "
                            "emulated)")
    extra.add_argument("--in-memory", action="store_true",
                       help="--scale: the model in the device's memory instead, beside the "
                            "streamed run of the same size")
    extra.add_argument("--variants", default=",".join(VARIANTS),
                       help="which of memory, stream-host, stream-nvme to run; memory first")
    known, rest = extra.parse_known_args()
    sys.argv = [sys.argv[0]] + rest
    args = benchlib.arguments(__doc__.split("\n\n")[0], steps, **defaults)
    for k, v in vars(known).items():
        setattr(args, k, v)
    args.variants = args.variants.split(",")
    if args.variants[0] != "memory" or not set(args.variants) <= set(VARIANTS):
        sys.exit(f"param_stream: --variants must start with memory and name only {VARIANTS}")
    if memory_variant:
        memory_of(args, memory_variant)
    elif args.scale:
        scale(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
