"""N LoRA jobs on one node: each streaming its own copy of the frozen base, beside all of them
streaming one shared base (stream_parameters(..., shared_base=NAME)).

A Llama-shaped bf16 checkpoint is written once; for each way, a fresh daemon and N job processes,
each building the model on meta, streaming it from the checkpoint (its own copy, or the shared
base: the first job makes it, the others open it), adding peft's LoRA (r=16 on q/k/v/o) and
training it with OffloadedAdamW. Measured, in the same run: the daemon's host-tier and NVMe bytes
once every job is set up, its peak RSS, each job's set-up time, its first step (and what that
step waited for the check of its checkpoint against the base, which runs in the background), and
the median LoRA step with every job stepping at once. Each job's losses must be the same both
ways (printed).

    python3 bench/shared_base.py [--jobs 2] [--layers 8 --hidden 1024] [--home nvme]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=6, help="LoRA steps of each job (1 warm-up)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens a step (one sequence)")
    ap.add_argument("--home", choices=["host", "nvme"], default="host",
                    help="where the base's units are at home")
    ap.add_argument("--host-capacity", default="2GiB")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shared", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("TIERD_CLIENT_LIB",
                          os.path.join(args.build, "client", "libtierd_client.so.0"))
    return args


def llama(args):
    import benchlib
    return benchlib.llama_config(args, "bfloat16")


def write_checkpoint(args, directory):
    import torch
    import transformers
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(llama(args), dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="200MB")
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
               if f.endswith(".safetensors"))


def child(args):
    """One job: set up, say so, wait for "go", step, print the step times and losses."""
    import peft
    import torch
    import transformers
    import tierd.torch
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(llama(args), dtype=torch.bfloat16)
    start = time.perf_counter()
    stream = tierd.torch.stream_parameters(
        model, checkpoint=args.ckpt, device=torch.device("cpu"), device_budget_bytes=64 << 30,
        host_budget_bytes=None if args.home == "host" else 0, socket_dir=args.child,
        shared_base=args.shared)
    setup = time.perf_counter() - start
    torch.manual_seed(args.seed)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        lora_dropout=0.0))
    opt = tierd.torch.OffloadedAdamW([p for p in model.parameters() if p.requires_grad],
                                     lr=1e-4, socket_dir=args.child, threads=1)
    print(json.dumps({"setup_s": setup}), flush=True)
    sys.stdin.readline()  # go
    g = torch.Generator().manual_seed(100 + args.seed)
    times, losses = [], []
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    print(json.dumps({"step_s": statistics.median(times[1:]), "first_step_s": times[0],
                      "check_wait_s": stream.stats.get("base_check_wait_s", 0.0),
                      "losses": losses}), flush=True)
    sys.stdin.readline()  # done: the parent has read the daemon's figures
    opt.close()
    stream.close()


def run(args, ckpt, shared):
    """One way: a fresh daemon, N jobs; returns the figures."""
    import benchlib
    from tierd.client import Tier, connect
    with benchlib.daemon(args.build, host_capacity=args.host_capacity, nvme="8GiB") as sock:
        jobs = []
        for i in range(args.jobs):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", sock, "--ckpt", ckpt,
                   "--seed", str(i)] + [a for a in sys.argv[1:]]
            if shared:
                cmd += ["--shared", "bench-base@1"]
            jobs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True))
            if i == 0:  # the first makes the base; the others open it
                first = json.loads(jobs[0].stdout.readline())
        setups = [first] + [json.loads(j.stdout.readline()) for j in jobs[1:]]
        with connect(sock, "bench probe") as c:
            host = c.tier_usage(Tier.HOST).used_bytes
            nvme = c.tier_usage(Tier.NVME).used_bytes
        for j in jobs:
            j.stdin.write("go\n")
            j.stdin.flush()
        steps = [json.loads(j.stdout.readline()) for j in jobs]
        rss = benchlib.daemon_peak_rss(sock)
        for j in jobs:
            j.stdin.write("done\n")
            j.stdin.flush()
            j.wait(timeout=600)
        return {"host_bytes": host, "nvme_bytes": nvme, "daemon_peak_rss": rss,
                "setup_s": [s["setup_s"] for s in setups],
                "step_s": [s["step_s"] for s in steps],
                "first_step_s": [s["first_step_s"] for s in steps],
                "check_wait_s": [s["check_wait_s"] for s in steps],
                "losses": [s["losses"] for s in steps]}


def main():
    args = arguments()
    if args.child is not None:
        return child(args)
    directory = tempfile.mkdtemp(prefix="tierd-shared-base-", dir=args.build)
    try:
        size = write_checkpoint(args, directory)
        own = run(args, directory, shared=False)
        one = run(args, directory, shared=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    gib = 1 << 30
    print(json.dumps({"checkpoint_bytes": size, "own": own, "shared": one}))
    print(f"{args.jobs} LoRA jobs, {args.layers} blocks of hidden {args.hidden} (bf16 "
          f"checkpoint {size / gib:.2f} GiB), units at home in {args.home}:")
    for what, key in (("host tier", "host_bytes"), ("NVMe", "nvme_bytes"),
                      ("daemon peak RSS", "daemon_peak_rss")):
        a, b = own[key], one[key]
        print(f"  {what:16s} own copies {a / gib:6.2f} GiB   shared {b / gib:6.2f} GiB   "
              f"ratio {b / a if a else float('nan'):.2f}")
    print(f"  set-up (s)       own {', '.join(f'{s:.2f}' for s in own['setup_s'])}   shared "
          f"{', '.join(f'{s:.2f}' for s in one['setup_s'])}")
    print(f"  first step (s)   own {', '.join(f'{s:.2f}' for s in own['first_step_s'])}   "
          f"shared {', '.join(f'{s:.2f}' for s in one['first_step_s'])} (waited for the base's "
          f"check {', '.join(f'{s:.2f}' for s in one['check_wait_s'])})")
    ms = [statistics.median(own["step_s"]), statistics.median(one["step_s"])]
    print(f"  median step      own {ms[0] * 1e3:.0f} ms   shared {ms[1] * 1e3:.0f} ms   "
          f"ratio {ms[1] / ms[0]:.2f}")
    print(f"  losses the same: {own['losses'] == one['losses']}")


if __name__ == "__main__":
    main()
