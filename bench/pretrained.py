"""A checkpoint in, streamed: a Llama-shaped model's safetensors shards (written first, unit by
unit, never the whole model in memory) read into the daemon's tiers by stream_parameters from a
model built on the meta device — beside fio reading the same files sequentially, alternating,
with the page cache dropped before each read when the machine allows it.

Each import runs in a process of its own, so that its peak resident set (VmHWM) is the import's:
it is printed beside the model's size, split into the process's private memory and the daemon's
shared memory written into.

--lora N: then N LoRA steps (peft, r=16 on q/k/v/o) of the model streamed from the checkpoint
with OffloadedAdamW, beside the same PEFT model loaded in memory by from_pretrained with
torch.optim.AdamW, alternating blocks of steps; the median step of each and their ratio.

--scale: the scale run. A model whose weights and optimizer state are larger than the machine's
memory (default 36 blocks of hidden 2048: 1.98 B parameters, 3.7 GiB of bf16 weights and 22 GiB
of fp32 optimizer state), its checkpoint written unit by unit, then in a process each: a few
LoRA steps, and a few steps of full fine-tuning, of the model built on meta and streamed from the
checkpoint with every block and the optimizer's state at home on NVMe; each step's loss and time,
the process's peak memory, the daemon's peak memory and host tier, and the NVMe bytes a step
beside the fewest a step must move with the host tier's memory (benchlib.step_minimum_bytes).

    python3 bench/pretrained.py [--layers 24 --hidden 2048 --intermediate 5504 --dtype bf16]
    python3 bench/pretrained.py --rounds 0 --lora 12 [--tokens 512]
    python3 bench/pretrained.py --scale [--layers 36 --steps 2 --host-capacity 2GiB]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Tuple

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--shard-size", default="500MB")
    ap.add_argument("--rounds", type=int, default=2, help="fio and import, alternating")
    ap.add_argument("--lora", type=int, default=0, help="LoRA steps of each, after the import")
    ap.add_argument("--tokens", type=int, default=512, help="tokens a LoRA step (one sequence)")
    ap.add_argument("--scale", action="store_true", help="the scale run (see above)")
    ap.add_argument("--steps", type=int, default=2, help="steps of each in the scale run")
    ap.add_argument("--host-capacity", default="2GiB", help="the daemon's host tier (--scale)")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    if "--scale" in sys.argv:
        ap.set_defaults(layers=36, hidden=2048, intermediate=5632, tokens=256)
    ap.add_argument("--dir", default=None, help="where the checkpoint is written (a temporary "
                    "directory under the build directory by default)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    # The import as it was before the daemon read checkpoints: pread by the process.
    ap.add_argument("--read-here", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--home", default="nvme", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("TIERD_CLIENT_LIB",
                          os.path.join(args.build, "client", "libtierd_client.so.0"))
    return args


def config(args):
    import benchlib
    return benchlib.llama_config(args, "bfloat16" if args.dtype == "bf16" else "float32")


def meta_model(args):
    import torch
    import transformers
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config(args), dtype=dtype)


def write_checkpoint(args, directory: str) -> int:
    """The model's checkpoint, each tensor made when its shard is written (normal(0, 0.02),
    norms ones): one shard in memory at a time. Returns its bytes."""
    import torch
    from tierd.torch import _pretrained
    model = meta_model(args)
    entries = [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]
    g = torch.Generator().manual_seed(0)

    def make(name):
        shape, dtype = next((s, d) for n, s, d in entries if n == name)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        return (torch.randn(shape, generator=g) * 0.02).to(dtype)

    _pretrained.write(directory, entries, make, _pretrained.parse_size(args.shard_size))
    config(args).save_pretrained(directory)
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
               if f.endswith(".safetensors"))


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fio(directory: str, direct: bool) -> float:
    """fio's sequential read of the shards (1 MiB requests, io_uring; buffered, or O_DIRECT as
    the daemon's import reads), in bytes/s."""
    files = sorted(os.path.join(directory, f) for f in os.listdir(directory)
                   if f.endswith(".safetensors"))
    # One job per file, one after another (--stonewall), each the file's own size; --readonly:
    # fio lays out (writes) a file shorter than the size it is given, which must never happen.
    cmd = ["fio", "--readonly", "--output-format=json"]
    for i, f in enumerate(files):
        cmd += [f"--name=read{i}", "--rw=read", "--bs=1M", "--ioengine=io_uring", f"--direct={int(direct)}",
                f"--filename={f}", f"--size={os.path.getsize(f)}", "--stonewall"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    jobs = [j["read"] for j in json.loads(out.stdout)["jobs"]]
    return sum(j["io_bytes"] for j in jobs) / (sum(j["runtime"] for j in jobs) / 1000.0)


def _status(key: str) -> int:
    import benchlib
    return benchlib.proc_status().get(key, 0)


def _read_by_this_process() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def cached_bytes(directory: str) -> int:
    """Bytes of the shards in the page cache (fincore)."""
    files = [os.path.join(directory, f) for f in os.listdir(directory)
             if f.endswith(".safetensors")]
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES"] + files,
                         capture_output=True, text=True, check=True)
    return sum(int(line) for line in out.stdout.split())


def child_import(args) -> None:
    """In a process of its own: the import, timed; prints JSON."""
    import torch
    import tierd.torch
    if args.read_here:
        from tierd.torch import _pretrained
        _pretrained.Checkpoint.span = lambda self, key: (
            lambda out: self.read_into(key, out))
    model = meta_model(args)
    read_before = _read_by_this_process()
    before = _status("VmRSS")
    anon_before = _status("RssAnon")
    biggest = max(sum(p.numel() * p.element_size() for p in layer.parameters())
                  for layer in model.model.layers)
    peak = {"RssAnon": 0, "RssShmem": 0}
    done = threading.Event()

    def sample():  # the peaks of private memory and of the daemon's shared memory touched
        while not done.wait(0.005):
            for key in peak:
                peak[key] = max(peak[key], _status(key))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    stream = tierd.torch.stream_parameters(model, checkpoint=args.dir, device=torch.device("cpu"),
                                           device_budget_bytes=64 << 30,
                                           host_budget_bytes=0 if args.home == "nvme" else None,
                                           socket_dir=args.child)
    seconds = time.perf_counter() - start
    read = _read_by_this_process() - read_before
    done.set()
    sampler.join()
    hwm = _status("VmHWM")
    resident = stream.resident_bytes
    stream.close()
    print(json.dumps({"seconds": seconds, "peak_rss": hwm, "before": before,
                      "anon_before": anon_before, "peak_anon": peak["RssAnon"],
                      "peak_shmem": peak["RssShmem"],
                      "largest_unit": biggest,
                      "resident": resident, "read": read, "cached": cached_bytes(args.dir)}))


def lora(args, directory: str, sock: str) -> None:
    """LoRA steps streamed beside in memory (see the module's text)."""
    import statistics
    import torch
    import peft
    import transformers
    import tierd.torch
    torch.set_num_threads(os.cpu_count() or 1)
    config = dict(r=16, lora_alpha=32, lora_dropout=0.0,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    torch.manual_seed(0)
    base = meta_model(args)
    stream = tierd.torch.stream_parameters(base, checkpoint=directory, device=torch.device("cpu"),
                                           device_budget_bytes=64 << 30, socket_dir=sock)
    streamed = peft.get_peft_model(base, peft.LoraConfig(**config))
    s_opt = tierd.torch.OffloadedAdamW([p for p in streamed.parameters() if p.requires_grad],
                                       lr=1e-4, socket_dir=sock, home="host",
                                       overlap_backward=True)
    torch.manual_seed(0)
    memory = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                 peft.LoraConfig(**config))
    m_opt = torch.optim.AdamW([p for p in memory.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
    times = {"streamed": [], "memory": []}
    runs = [("streamed", streamed, s_opt), ("memory", memory, m_opt)]
    for block in range(args.lora // 2 + 1):
        for name, model, opt in runs if block % 2 == 0 else runs[::-1]:
            for _ in range(2):
                t0 = time.perf_counter()
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if block > 0:  # the first block warms up
                    times[name].append(time.perf_counter() - t0)
    s, m = statistics.median(times["streamed"]), statistics.median(times["memory"])
    trainable = sum(p.numel() for p in streamed.parameters() if p.requires_grad)
    print(f"LoRA (r=16 on q/k/v/o, {trainable / 1e6:.1f} M trainable), {args.tokens} tokens a "
          f"step, median of {len(times['streamed'])}: streamed from the checkpoint "
          f"{s * 1000:.0f} ms, the same PEFT model in memory with torch's AdamW "
          f"{m * 1000:.0f} ms: {s / m:.2f}x; base traffic {stream.stats['h2d_bytes'] / 2**30:.1f} "
          f"GiB in, {stream.stats['d2h_bytes']} bytes out")
    s_opt.close()
    stream.close()


def _nvme_bytes(client) -> Tuple[int, int]:
    return client.path_bytes("nvme_to_host"), client.path_bytes("host_to_nvme")


def child_train(args) -> None:
    """In a process of its own (--scale): LoRA or full fine-tuning steps of the model streamed
    from the checkpoint; prints JSON."""
    import torch
    import tierd
    import tierd.torch
    torch.set_num_threads(os.cpu_count() or 1)
    sock = args.child
    model = meta_model(args)
    probe = tierd.connect(sock, "bench probe")
    start = time.perf_counter()
    stream = tierd.torch.stream_parameters(model, checkpoint=args.dir, device=torch.device("cpu"),
                                           device_budget_bytes=8 << 30, host_budget_bytes=0,
                                           socket_dir=sock, name=f"scale-{args.mode}")
    import_s = time.perf_counter() - start
    if args.mode == "lora":
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    params = [p for p in model.parameters() if p.requires_grad]
    start = time.perf_counter()
    opt = tierd.torch.OffloadedAdamW(params, lr=1e-5, socket_dir=sock, home="nvme",
                                     host_budget_bytes=256 << 20, overlap_backward=True)
    opt_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(0)
    steps = []
    before = _nvme_bytes(probe)
    for step in range(args.steps):
        x = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append({"loss": loss.item(), "seconds": time.perf_counter() - t0})
        print(json.dumps({"progress": steps[-1]}), flush=True)
    after = _nvme_bytes(probe)
    host = probe.tier_usage(tierd.Tier.HOST)
    out = {"import_s": import_s, "optimizer_s": opt_s, "steps": steps,
           "trainable": sum(p.numel() for p in params),
           "state_bytes": opt.state_bytes, "peak_rss": _status("VmHWM"),
           "rss_anon": _status("RssAnon"), "nvme_read": after[0] - before[0],
           "nvme_written": after[1] - before[1], "host_used": host.used_bytes,
           "host_capacity": host.capacity_bytes}
    opt.close()
    stream.close()
    probe.close()
    print(json.dumps(out), flush=True)


def scale(args, directory: str) -> None:
    """The scale run (see the module's text)."""
    import benchlib
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    model = meta_model(args)
    n = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = 12 * n
    print(f"scale: {n / 1e9:.2f} B parameters, {weights / 2**30:.1f} GiB of {args.dtype} weights "
          f"and {state / 2**30:.1f} GiB of fp32 optimizer state: {(weights + state) / 2**30:.1f} "
          f"GiB, the machine has {mem / 2**30:.1f} GiB of memory", flush=True)
    start = time.perf_counter()
    size = write_checkpoint(args, directory)
    print(f"checkpoint: {size / 2**30:.2f} GiB written unit by unit in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    nvme = f"{int((2 * weights + 2 * state + (1 << 30)) / 2**30) + 4}GiB"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    with benchlib.daemon(args.build, host_capacity=args.host_capacity, nvme=nvme) as sock:
        for mode in ("lora", "full"):
            cmd = [sys.executable, __file__, "--child", sock, "--mode", mode, "--dir", directory,
                   "--layers", str(args.layers), "--hidden", str(args.hidden),
                   "--intermediate", str(args.intermediate), "--heads", str(args.heads),
                   "--vocab", str(args.vocab), "--dtype", args.dtype, "--build", args.build,
                   "--steps", str(args.steps), "--tokens", str(args.tokens)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"{mode}: {out.stderr[-4000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            daemon_peak = benchlib.daemon_peak_rss(sock)
            steps = ", ".join(f"{s['loss']:.4f} in {s['seconds']:.0f} s" for s in r["steps"])
            # Every weight at home on NVMe; LoRA trains adapters in memory, full trains them all.
            trains_streamed = n if mode == "full" else 0
            least = benchlib.step_minimum_bytes(4 if args.dtype == "fp32" else 2, n,
                                                trains_streamed, r["trainable"],
                                                r["host_capacity"])
            read, written = (r[k] / args.steps for k in ("nvme_read", "nvme_written"))
            times = (f": {read / least[0]:.2f} x / {written / least[1]:.2f} x" if min(least) > 0
                     else "")
            print(f"{mode}: {r['trainable'] / 1e6:,.1f} M trainable, optimizer state "
                  f"{r['state_bytes'] / 2**30:.2f} GiB; import {r['import_s']:.0f} s, optimizer "
                  f"made in {r['optimizer_s']:.0f} s; steps (loss, time): {steps}; process peak "
                  f"RSS {r['peak_rss'] / 2**30:.2f} GiB (private {r['rss_anon'] / 2**30:.2f} GiB "
                  f"at the end); daemon peak RSS {daemon_peak / 2**30:.2f} GiB, host tier "
                  f"{r['host_used'] / 2**30:.2f} of {r['host_capacity'] / 2**30:.2f} GiB in use "
                  f"at the end; NVMe a step: {read / 2**30:.1f} GiB read, "
                  f"{written / 2**30:.1f} GiB written (fewest {least[0] / 2**30:.1f} / "
                  f"{least[1] / 2**30:.1f} GiB{times})", flush=True)


def main():
    args = arguments()
    if args.child is not None:
        return child_train(args) if args.mode else child_import(args)
    import benchlib
    own = args.dir is None
    directory = args.dir or tempfile.mkdtemp(prefix="tierd-ckpt-", dir=args.build)
    args.dir = directory
    if args.scale:
        try:
            return scale(args, directory)
        finally:
            if own:
                shutil.rmtree(directory, ignore_errors=True)
    try:
        start = time.perf_counter()
        size = write_checkpoint(args, directory)
        shards = len([f for f in os.listdir(directory) if f.endswith(".safetensors")])
        print(f"checkpoint: {size / 2**30:.2f} GiB in {shards} safetensors file(s), "
              f"written unit by unit in {time.perf_counter() - start:.1f} s")
        dropped = drop_caches()
        print("page cache dropped before each read" if dropped else
              "the page cache could not be dropped (not root): reads may come from memory")
        nvme = f"{max(4, int(3 * size / 2**30) + 2)}GiB"  # two versions and room
        # Room for both versions of every unit, for the imports into units at home on the host.
        host = f"{max(1, int(2 * size / 2**30) + 2)}GiB"
        with benchlib.daemon(args.build, host_capacity=host, nvme=nvme) as sock:
            rows = []
            for r in range(args.rounds):
                rates = {}
                for direct in (False, True):
                    drop_caches()
                    rates[direct] = fio(directory, direct)
                print(f"round {r + 1}: fio buffered {rates[False] / 2**20:.0f} MiB/s, O_DIRECT "
                      f"{rates[True] / 2**20:.0f} MiB/s")
                for here, home in ((False, "host"), (False, "nvme"), (True, "nvme")):
                    drop_caches()
                    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", sock, "--dir", directory,
                         "--layers", str(args.layers), "--hidden", str(args.hidden),
                         "--intermediate", str(args.intermediate), "--heads", str(args.heads),
                         "--vocab", str(args.vocab), "--dtype", args.dtype, "--build",
                         args.build, "--home", home] + (["--read-here"] if here else []),
                        capture_output=True, text=True, env=env)
                    if out.returncode != 0:
                        sys.exit(out.stderr)
                    imp = json.loads(out.stdout.strip().splitlines()[-1])
                    rate = size / imp["seconds"]
                    best_fio = max(rates.values())
                    rows.append((best_fio, rate, (here, home)))
                    who = (f"read by the {'process (pread)' if here else 'daemon'}, units at home "
                           f"in {'the host tier' if home == 'host' else 'NVMe (written down)'}")
                    print(f"  import {who}: {rate / 2**20:.0f} MiB/s ({rate / best_fio:.2f}x "
                          f"fio's faster), {imp['seconds']:.1f} s; the process read "
                          f"{imp['read'] / 2**20:.0f} MiB, the shards' pages cached after it "
                          f"{imp['cached'] / 2**20:.0f} MiB of {size / 2**20:.0f} MiB; peak RSS "
                          f"{imp['peak_rss'] / 2**20:.0f} MiB ({imp['before'] / 2**20:.0f} MiB "
                          f"before, torch and transformers loaded; largest unit "
                          f"{imp['largest_unit'] / 2**20:.0f} MiB, resident "
                          f"{imp['resident'] / 2**20:.0f} MiB); private memory grew by "
                          f"{(imp['peak_anon'] - imp['anon_before']) / 2**20:.0f} MiB", flush=True)
            for how in sorted({row[2] for row in rows}):
                mine = [row for row in rows if row[2] == how]
                best = max(mine, key=lambda row: row[1] / row[0])
                print(f"best round, {'pread' if how[0] else 'daemon'}, {how[1]} home: import at "
                      f"{best[1] / best[0]:.2f}x fio's faster sequential read")
            if args.lora:
                lora(args, directory, sock)
    finally:
        if own:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
