"""A checkpoint in, streamed: a Llama-shaped model's safetensors shards (written first, unit by
unit, never the whole model in memory) read into the daemon's tiers by stream_parameters from a
model built on the meta device — beside fio reading the same files sequentially, alternating,
with the page cache dropped before each read when the machine allows it. An import into units at
home on NVMe also writes every unit there: beside it, too, fio reading the files while it writes
as many bytes to the same disk.

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
the process's peak memory, the daemon's peak memory and host tier, and each step's NVMe bytes
(the stream's and the optimizer's) beside the fewest a step must move with the host tier's memory
(benchlib.step_minimum_bytes) and beside the time those bytes take at fio's rates on the same disk
(measured before and after the steps). --memory-limit holds the whole run, page cache included,
to that much memory by a memory cgroup: a machine of that size, where the disk cannot hold a
model twice the machine's memory.

    python3 bench/pretrained.py [--layers 24 --hidden 2048 --intermediate 5504 --dtype bf16]
    python3 bench/pretrained.py --rounds 0 --lora 12 [--tokens 512]
    python3 bench/pretrained.py --scale [--layers 36 --steps 2 --host-capacity 2GiB]
                                [--memory-limit 12GiB]
"""
import argparse
import contextlib
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
    ap.add_argument("--memory-limit", default=None, help="the scale run held to this much "
                    "memory, page cache included, by a memory cgroup (needs root)")
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
    from tierd.torch import _safetensors
    model = meta_model(args)
    entries = [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]
    g = torch.Generator().manual_seed(0)

    def make(name):
        shape, dtype = next((s, d) for n, s, d in entries if n == name)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        return (torch.randn(shape, generator=g) * 0.02).to(dtype)

    _safetensors.write(directory, entries, make, _safetensors.parse_size(args.shard_size))
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


def fio_read_write(directory: str, scratch: str) -> float:
    """The yardstick for an import into units at home on NVMe, which moves each byte twice: fio
    reading each shard (O_DIRECT, io_uring, 1 MiB) while it writes as many bytes (O_DIRECT, synced
    at the end) over `scratch`, a file on the same disk written once beforehand (overwriting is
    the faster case, so the yardstick is the stricter one). Checkpoint bytes a second: the
    shards' size over the wall time of the pairs, one pair after another."""
    files = sorted(os.path.join(directory, f) for f in os.listdir(directory)
                   if f.endswith(".safetensors"))
    sizes = [os.path.getsize(f) for f in files]
    mib = 1 << 20  # each pair writes from a MiB boundary: O_DIRECT wants aligned offsets
    spans = [(size + mib - 1) // mib * mib for size in sizes]
    room = sum(spans)
    if not os.path.exists(scratch) or os.path.getsize(scratch) < room:
        with open(scratch, "wb") as f:
            zeros = bytes(16 * mib)
            for _ in range(0, room, len(zeros)):
                f.write(zeros)
            os.fsync(f.fileno())
    cmd = ["fio", "--output-format=json"]
    offset = 0
    for i, (f, size, span) in enumerate(zip(files, sizes, spans)):
        common = ["--bs=1M", "--ioengine=io_uring", "--direct=1", f"--size={size}"]
        cmd += [f"--name=read{i}", "--rw=read", f"--filename={f}", "--stonewall",
                *common]
        cmd += [f"--name=write{i}", "--rw=write", f"--filename={scratch}", f"--offset={offset}",
                "--end_fsync=1", *common]
        offset += span
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"fio failed: {out.stderr or out.stdout}")
    jobs = json.loads(out.stdout)["jobs"]
    # Each pair starts together; it ends when the slower of its two ends.
    wall = sum(max(jobs[2 * i]["read"]["runtime"], jobs[2 * i + 1]["write"]["runtime"])
               for i in range(len(files))) / 1000.0
    return sum(sizes) / wall


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
        from tierd.torch import _safetensors
        _safetensors.Checkpoint.span = lambda self, key: (
            lambda out: self.read_into(key, out))
    # The time spent in the daemon's reads (Client.import_file), beside the whole call's.
    from tierd.client import Client
    reads = {"seconds": 0.0, "bytes": 0}
    import_file = Client.import_file

    def timed_import(self, *a, **kw):
        start = time.perf_counter()
        got = import_file(self, *a, **kw)
        reads["seconds"] += time.perf_counter() - start
        reads["bytes"] += got[0]
        return got
    Client.import_file = timed_import
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
                      "resident": resident, "read": read, "cached": cached_bytes(args.dir),
                      "daemon_read_bytes": reads["bytes"],
                      "daemon_read_seconds": reads["seconds"]}))


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
    from the checkpoint; prints JSON, with each step's NVMe bytes by role."""
    import torch
    import tierd
    import tierd.torch
    import benchlib
    from tierd.torch import _safetensors
    torch.set_num_threads(os.cpu_count() or 1)
    sock = args.child
    model = meta_model(args)
    probe = tierd.connect(sock, "bench probe")
    start = time.perf_counter()
    # Each role's sessions in a job of their own, so that the daemon counts the bytes each
    # moved (tierd_job_moved_bytes_total): the stream's weights and the optimizer's state.
    os.environ["TIERD_JOB"] = "scale-stream"
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
    # The optimizer's budget is the host tier's share the streamed weights leave: half of it, as
    # in bench/deepspeed_side_by_side.py.
    os.environ["TIERD_JOB"] = "scale-optimizer"
    opt = tierd.torch.OffloadedAdamW(params, lr=1e-5, socket_dir=sock, home="nvme",
                                     host_budget_bytes=_safetensors.parse_size(
                                         args.host_capacity) // 2,
                                     overlap_backward=True)
    del os.environ["TIERD_JOB"]
    opt_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(0)
    steps = []
    before, jobs = _nvme_bytes(probe), benchlib.job_traffic(sock)
    for step in range(args.steps):
        x = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        after, now = _nvme_bytes(probe), benchlib.job_traffic(sock)
        by_role = {}
        for (job, path), v in now.items():
            by_role.setdefault(job.removeprefix("scale-"), {})[path] = v - jobs.get((job, path), 0)
        steps.append({"loss": loss.item(), "seconds": seconds, "read": after[0] - before[0],
                      "written": after[1] - before[1], "by_role": by_role})
        before, jobs = after, now
        print(json.dumps({"progress": steps[-1]}), flush=True)
    host = probe.tier_usage(tierd.Tier.HOST)
    out = {"import_s": import_s, "optimizer_s": opt_s, "steps": steps,
           "trainable": sum(p.numel() for p in params),
           "state_bytes": opt.state_bytes, "peak_rss": _status("VmHWM"),
           "rss_anon": _status("RssAnon"), "host_used": host.used_bytes,
           "host_capacity": host.capacity_bytes}
    opt.close()
    stream.close()
    probe.close()
    print(json.dumps(out), flush=True)


def fio_rates(directory: str, size: int = 4 << 30) -> Tuple[float, float]:
    """fio's sequential write and then read of a scratch file of `size` in `directory` (O_DIRECT,
    io_uring, 1 MiB requests at queue depth 32, tierd's I/O size and depth), each into its own
    buffers and into shared 4 KiB pages (the host tier's kind without huge pages); the faster of
    the two for each direction, in bytes/s."""
    path = os.path.join(directory, "fio.scratch")
    rates = {"write": 0.0, "read": 0.0}
    try:
        for rw in ("write", "read"):
            for mem in ("malloc", "mmapshared"):
                cmd = ["fio", "--output-format=json", "--name=scale", f"--rw={rw}", "--bs=1M",
                       "--ioengine=io_uring", "--direct=1", "--iodepth=32", "--fixedbufs=1",
                       "--registerfiles=1", f"--iomem={mem}", f"--filename={path}",
                       f"--size={size}", "--end_fsync=1"]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                job = json.loads(out.stdout)["jobs"][0][rw]
                rates[rw] = max(rates[rw], job["io_bytes"] / (job["runtime"] / 1000.0))
    finally:
        if os.path.exists(path):
            os.remove(path)
    return rates["write"], rates["read"]


class MemoryLimit:
    """This process and its children (the daemon, the trainers) in a memory cgroup of `limit`
    bytes, page cache included: a machine of that much memory. Needs root; cgroup v2 or v1."""

    def __init__(self, limit: int):
        self.limit = limit
        v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
        base = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory"
        self.root = base
        self.path = os.path.join(base, f"tierd-scale-{os.getpid()}")
        self.max_file, self.peak_file = (("memory.max", "memory.peak") if v2 else
                                         ("memory.limit_in_bytes", "memory.max_usage_in_bytes"))

    def __enter__(self):
        try:
            os.mkdir(self.path)
            with open(os.path.join(self.path, self.max_file), "w") as f:
                f.write(str(self.limit))
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            if os.path.isdir(self.path):
                os.rmdir(self.path)
            sys.exit(f"--memory-limit needs a memory cgroup this user may create: {e}")
        return self

    def peak(self) -> int:
        """The cgroup's peak memory use so far (0 where the kernel does not say)."""
        try:
            with open(os.path.join(self.path, self.peak_file)) as f:
                return int(f.read().split()[0])
        except OSError:
            return 0

    def __exit__(self, *exc):
        with open(os.path.join(self.root, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(self.path)


def scale(args, directory: str) -> None:
    """The scale run (see the module's text)."""
    from tierd.torch import _safetensors
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _safetensors.parse_size(args.memory_limit) if args.memory_limit else 0
    model = meta_model(args)
    n = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = 12 * n
    given = limit or mem
    print(f"scale: {n / 1e9:.2f} B parameters, {weights / 2**30:.1f} GiB of {args.dtype} weights "
          f"and {state / 2**30:.1f} GiB of fp32 optimizer state: {(weights + state) / 2**30:.1f} "
          f"GiB, {(weights + state) / given:.2f} x the {given / 2**30:.1f} GiB of memory the run "
          f"has" + (f" (held to it by a memory cgroup, page cache included; the machine has "
                    f"{mem / 2**30:.1f} GiB)" if limit else ""), flush=True)
    with (MemoryLimit(limit) if limit else contextlib.nullcontext()) as cgroup:
        blocks = sum(p.numel() for p in model.model.layers.parameters())
        scale_steps(args, directory, blocks, weights, state)
        if cgroup is not None:
            print(f"the run's peak memory use, page cache included: "
                  f"{cgroup.peak() / 2**30:.2f} GiB of {limit / 2**30:.1f}", flush=True)


def scale_steps(args, directory: str, blocks: int, weights: int, state: int) -> None:
    """The scale run's checkpoint, daemon and trainers, fio on the same disk before and after;
    `blocks` is the parameters streamed."""
    import benchlib
    start = time.perf_counter()
    size = write_checkpoint(args, directory)
    print(f"checkpoint: {size / 2**30:.2f} GiB written unit by unit in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    fio_before = fio_rates(directory)
    nvme = f"{int((2 * weights + 2 * state + (1 << 30)) / 2**30) + 4}GiB"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    results = {}
    with benchlib.daemon(args.build, host_capacity=args.host_capacity, nvme=nvme) as sock:
        for mode in ("lora", "full"):
            cmd = [sys.executable, __file__, "--child", sock, "--mode", mode, "--dir", directory,
                   "--layers", str(args.layers), "--hidden", str(args.hidden),
                   "--intermediate", str(args.intermediate), "--heads", str(args.heads),
                   "--vocab", str(args.vocab), "--dtype", args.dtype, "--build", args.build,
                   "--steps", str(args.steps), "--tokens", str(args.tokens),
                   "--host-capacity", args.host_capacity]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"{mode}: {out.stderr[-4000:]}")
            results[mode] = (json.loads(out.stdout.strip().splitlines()[-1]),
                             benchlib.daemon_peak_rss(sock))
    fio_after = fio_rates(directory)
    fio_write, fio_read = (max(a, b) for a, b in zip(fio_before, fio_after))
    print(f"fio on the same disk, before and after the steps: write {fio_before[0] / 1e9:.2f} "
          f"and {fio_after[0] / 1e9:.2f} GB/s, read {fio_before[1] / 1e9:.2f} and "
          f"{fio_after[1] / 1e9:.2f} GB/s (the faster of each is the yardstick)", flush=True)
    for mode, (r, daemon_peak) in results.items():
        # The blocks at home on NVMe (the embedding and the head resident in the trainer); LoRA
        # trains adapters in memory, full fine-tuning every parameter.
        trains_streamed = blocks if mode == "full" else 0
        least = benchlib.step_minimum_bytes(4 if args.dtype == "fp32" else 2, blocks,
                                            trains_streamed, r["trainable"], r["host_capacity"])
        print(f"{mode}: {r['trainable'] / 1e6:,.1f} M trainable, optimizer state "
              f"{r['state_bytes'] / 2**30:.2f} GiB; import {r['import_s']:.0f} s, optimizer made "
              f"in {r['optimizer_s']:.0f} s; process peak RSS {r['peak_rss'] / 2**30:.2f} GiB "
              f"(private {r['rss_anon'] / 2**30:.2f} GiB at the end); daemon peak RSS "
              f"{daemon_peak / 2**30:.2f} GiB, host tier {r['host_used'] / 2**30:.2f} of "
              f"{r['host_capacity'] / 2**30:.2f} GiB in use at the end; fewest a step "
              f"{least[0] / 2**30:.1f} GiB read / {least[1] / 2**30:.1f} written", flush=True)
        for k, s in enumerate(r["steps"]):
            at_fio = s["read"] / fio_read + s["written"] / fio_write
            roles = "; ".join(
                f"{role} {p.get('nvme_to_host', 0) / 2**30:.1f} / "
                f"{p.get('host_to_nvme', 0) / 2**30:.1f}" for role, p in sorted(s["by_role"].items()))
            times = (f" ({s['read'] / least[0]:.2f} x / {s['written'] / least[1]:.2f} x the "
                     f"fewest)" if min(least) > 0 else "")
            pace = (f"; those bytes at fio's rates {at_fio:.1f} s: the step took "
                    f"{s['seconds'] / at_fio:.2f} x" if at_fio > 0 else "")
            print(f"  step {k + 1}{' (traced)' if k == 0 else ''}: loss {s['loss']:.4f} in "
                  f"{s['seconds']:.1f} s; NVMe {s['read'] / 2**30:.1f} GiB read / "
                  f"{s['written'] / 2**30:.1f} written{times}, by role {roles}{pace}", flush=True)


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
    scratch = directory + ".fio-scratch"
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
                drop_caches()
                both = fio_read_write(directory, scratch)
                print(f"round {r + 1}: fio buffered {rates[False] / 2**20:.0f} MiB/s, O_DIRECT "
                      f"{rates[True] / 2**20:.0f} MiB/s; reading O_DIRECT while writing as many "
                      f"bytes {both / 2**20:.0f} MiB/s")
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
                    rows.append((best_fio, rate, (here, home), both))
                    who = (f"read by the {'process (pread)' if here else 'daemon'}, units at home "
                           f"in {'the host tier' if home == 'host' else 'NVMe (written down)'}")
                    beside = (f", {rate / both:.2f}x fio reading and writing" if home == "nvme"
                              else "")
                    print(f"  import {who}: {rate / 2**20:.0f} MiB/s ({rate / best_fio:.2f}x "
                          f"fio's faster read{beside}), {imp['seconds']:.1f} s; the process read "
                          f"{imp['read'] / 2**20:.0f} MiB, the shards' pages cached after it "
                          f"{imp['cached'] / 2**20:.0f} MiB of {size / 2**20:.0f} MiB; peak RSS "
                          f"{imp['peak_rss'] / 2**20:.0f} MiB ({imp['before'] / 2**20:.0f} MiB "
                          f"before, torch and transformers loaded; largest unit "
                          f"{imp['largest_unit'] / 2**20:.0f} MiB, resident "
                          f"{imp['resident'] / 2**20:.0f} MiB); private memory grew by "
                          f"{(imp['peak_anon'] - imp['anon_before']) / 2**20:.0f} MiB", flush=True)
                    if imp["daemon_read_seconds"] > 0:  # units at home on the host: reads only
                        own = imp["daemon_read_bytes"] / imp["daemon_read_seconds"]
                        print(f"    of it, the daemon's reads: "
                              f"{imp['daemon_read_bytes'] / 2**20:.0f} MiB in "
                              f"{imp['daemon_read_seconds']:.1f} s, {own / 2**20:.0f} MiB/s"
                              + (f" ({own / best_fio:.2f}x fio's faster read)"
                                 if home == "host" else ""), flush=True)
            for how in sorted({row[2] for row in rows}):
                mine = [row for row in rows if row[2] == how]
                best = max(mine, key=lambda row: row[1] / row[0])
                print(f"best round, {'pread' if how[0] else 'daemon'}, {how[1]} home: import at "
                      f"{best[1] / best[0]:.2f}x fio's faster sequential read" +
                      (f", {best[1] / best[3]:.2f}x fio reading while writing as many bytes"
                       if how[1] == "nvme" else ""))
            if args.lora:
                lora(args, directory, sock)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch)
        if own:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
