"""tierd beside DeepSpeed, measured in one run: the same Llama-shaped model, data, batch and AdamW
hyperparameters trained by

  ds-offload   DeepSpeed ZeRO-3, offload_optimizer to the CPU (DeepSpeedCPUAdam)
  ds-infinity  DeepSpeed ZeRO-3, offload_param and offload_optimizer to NVMe (ZeRO-Infinity) as
               its users configure it for a model larger than RAM: every weight on NVMe
               (max_in_cpu 0), swap buffers sized for the largest weight, the live weights
               bounded as the stream's window is (--live, a share of the weights)
  ds-infinity-cached
               the same with offload_param's default max_in_cpu (1e9 elements): for these sizes
               every weight stays in RAM, and only the optimizer state goes to NVMe
  tierd-state  tierd's OffloadedAdamW as made by default (the weights in memory): its state at
               home in the host tier where it fits the tier, else on NVMe
  tierd-stream tierd streaming the weights (at home on NVMe) and OffloadedAdamW's state as made
               by default: on NVMe where it outgrows half the host tier
  tierd-state-split, tierd-stream-split (not run unless named)
               the same with --device-share of the optimizer stepped on the device (on the
               CPU, the daemon's emulated one)

each in a process of its own (DeepSpeed: its CPU accelerator and gloo on a machine without a GPU,
its CUDA one with a GPU; tierd: a fresh daemon, its NVMe region a file beside DeepSpeed's swap
directory), alternating mode by mode for --rounds rounds. Every mode starts from one checkpoint
the parent writes (seed 0), loaded as its users load it: DeepSpeed's through transformers'
HfDeepSpeedConfig and from_pretrained, so that ZeRO-3 builds the model under zero.Init in the run's
dtype (deepspeed.initialize() over a model built in memory converts it, and picks bf16 on a CPU
even in an fp32 run). Each mode's first loss, before any update, is checked against torch's on
the same batch (a child of its own): a mode that starts from other weights is reported as broken,
not timed. Each child takes one warm-up step and
--steps timed ones; it reports its median step, its peak RSS (VmHWM), the bytes it and its daemon
read and wrote to storage over the timed steps (/proc/PID/io) and its losses. A mode that cannot
run here is reported with its error. The table gives each mode's step as a ratio to tierd's
streamed one, the RAM it was given beside tierd-stream's (DeepSpeed's peak RSS, its swap buffers
in it; tierd's trainer's peak RSS plus the whole host tier its daemon is given, the tier's pages
the trainer maps, which its RSS counts as well, counted once), its bytes a step beside the fewest
a step must move where its weights and state are at home with --host-capacity of memory to keep
them in (benchlib.step_minimum_bytes; every
mode is measured against that memory; not for the -split modes, whose state is partly on the
device), tierd's bytes by role (the stream's weights and gradients, the optimizer's state: each
role's sessions are a job of their own, counted by the daemon's tierd_job_moved_bytes_total), what
tierd's optimizer waited a step for its state and its step's tail after backward (medians of its
last_stats), and the losses' largest difference from the first mode's.

    python3 bench/deepspeed_side_by_side.py [--hidden 512 --layers 4 --seq 256 --batch 4]
        [--modes ds-offload,ds-infinity,tierd-state,tierd-stream] [--dtype fp32|bf16]
        [--device cpu|cuda] [--device-share auto|0.5]
"""
import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)

import benchlib  # noqa: E402

MODES = ["ds-offload", "ds-infinity", "ds-infinity-cached", "tierd-state", "tierd-stream"]
SPLIT = ["tierd-state-split", "tierd-stream-split"]  # the optimizer split with the device
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps a child, after a warm-up")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--live", type=float, default=0.3, help="ds-infinity's live weights "
                    "(stage3_max_live_parameters) as a share of the model's")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default=None, help="where NVMe files go (DeepSpeed's swap, tierd's "
                    "region): a temporary directory under the build directory by default")
    ap.add_argument("--host-capacity", default="1GiB", help="tierd's host tier (the daemon "
                    "maps and populates it whole at start: its RSS)")
    ap.add_argument("--nvme", default="8GiB")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--init", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--socket-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, default=HYPER["lr"])
    ap.add_argument("--device-share", default="auto",
                    type=lambda s: s if s == "auto" else float(s),
                    help="the -split modes' OffloadedAdamW device_share (a number in [0, 1] or "
                         "auto); on the CPU their daemon gets an emulated device for it")
    args = ap.parse_args()
    os.environ.setdefault("TIERD_CLIENT_LIB",
                          os.path.join(args.build, "client", "libtierd_client.so.0"))
    return args


# ---- a child: one mode's training ----

def _io(pid) -> list:
    """Bytes the process read from and wrote to storage (not the page cache)."""
    got = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, v = line.split(":")
            got[k] = int(v)
    return [got["read_bytes"], got["write_bytes"]]


def dtype_of(args):
    import torch
    return torch.bfloat16 if args.dtype == "bf16" else torch.float32


def write_init(args, directory: str) -> str:
    """The checkpoint every mode starts from (seed 0), in the run's dtype."""
    import torch
    import transformers
    config = benchlib.llama_config(args, str(dtype_of(args)).removeprefix("torch."),
                                   max_position_embeddings=max(args.seq, 128))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype_of(args))
    path = os.path.join(directory, "init")
    model.save_pretrained(path)
    args.params = sum(p.numel() for p in model.parameters())
    return path


# Where each mode keeps its weights and its optimizer state between steps.
WEIGHTS_ON_NVME = {"ds-infinity", "tierd-stream"}
STATE_ON_NVME = {"ds-infinity", "ds-infinity-cached", "tierd-state", "tierd-stream"}


def minimum_bytes(args, mode):
    """(read, written) the fewest a step of `mode` must move with tierd's host tier of memory
    (benchlib.step_minimum_bytes), or None for a mode whose state is partly on the device."""
    from tierd.torch import _safetensors
    if mode in SPLIT:
        return None
    # ZeRO-Infinity swaps every weight; tierd streams the blocks, the embedding, the head and the
    # final norm resident in the trainer.
    blocks = args.params - 2 * args.vocab * args.hidden - args.hidden
    streamed = {"ds-infinity": args.params, "tierd-stream": blocks}.get(mode, 0)
    return benchlib.step_minimum_bytes(4 if args.dtype == "fp32" else 2, streamed, streamed,
                                       args.params if mode in STATE_ON_NVME else 0,
                                       _safetensors.parse_size(args.host_capacity))


def model_of(args):
    """The model from the run's checkpoint, in memory."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(args.init, dtype=dtype_of(args))


def batches(args, n):
    import torch
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(n)]


def deepspeed_config(args, swap):
    """The DeepSpeed config of a ds- mode, sized from the run's model shape."""
    import transformers
    shapes = transformers.AutoConfig.from_pretrained(args.init)
    h, i, v, n = shapes.hidden_size, shapes.intermediate_size, shapes.vocab_size, \
        shapes.num_hidden_layers
    kv = h * shapes.num_key_value_heads // shapes.num_attention_heads  # k's and v's width
    largest = max(v * h, h * i)
    # Embeddings and the untied head; per block q, o (h x h), k, v (h x kv), the MLP, two norms.
    total = 2 * v * h + n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "stage3_param_persistence_threshold": 0}
    if args.child.startswith("ds-infinity"):
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap, "pin_memory": False,
                                 "buffer_count": 5, "buffer_size": largest}
        if args.child == "ds-infinity":  # every weight on NVMe, the live ones bounded
            zero["offload_param"]["max_in_cpu"] = 0
            zero["stage3_max_live_parameters"] = int(args.live * total)
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap, "pin_memory": False,
                                     "buffer_count": 4}
    return {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "zero_optimization": zero, "gradient_clipping": 0.0, "steps_per_print": 1 << 30,
        "optimizer": {"type": "AdamW", "params": {
            "lr": HYPER["lr"], "betas": list(HYPER["betas"]), "eps": HYPER["eps"],
            "weight_decay": HYPER["weight_decay"]}},
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1,
                "single_submit": False, "overlap_events": True},
        "bf16": {"enabled": args.dtype == "bf16"},
    }


def deepspeed_engine(args, swap):
    """The model built as transformers builds it for ZeRO-3 (under zero.Init, from the
    checkpoint), and its engine."""
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig
    config = deepspeed_config(args, swap)
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    keep = HfDeepSpeedConfig(config)  # noqa: F841 (from_pretrained reads it while it lives)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.init, dtype=dtype_of(args))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return engine


def first_loss(args) -> None:
    """torch's loss on the first batch, before any update: what every mode must start from."""
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    x = batches(args, 1)[0]
    with torch.no_grad():
        loss = model_of(args)(input_ids=x, labels=x).loss
    print("RESULT " + json.dumps({"mode": "torch", "loss": float(loss.float())}), flush=True)


def child(args) -> None:
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    mode = args.child
    device = torch.device(args.device)
    data = batches(args, 1 + args.steps)
    daemon_pid = probe = opt = None
    cleanup = []
    HYPER["lr"] = args.lr
    if mode.startswith("ds-"):
        swap = os.path.join(args.dir, f"swap-{os.getpid()}")
        os.makedirs(swap, exist_ok=True)
        engine = deepspeed_engine(args, swap)

        def step(x):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            return loss
    else:
        import tierd.torch
        model = model_of(args)
        daemon_pid = benchlib.daemon_pid(args.socket_dir)
        probe = tierd.connect(args.socket_dir, "bench probe")
        cleanup.append(probe.close)
        # Each role's sessions in a job of their own, so that the daemon counts the bytes each
        # moved (tierd_job_moved_bytes_total): the stream's weights and the optimizer's state.
        os.environ["TIERD_JOB"] = "bench-stream"
        if mode.startswith("tierd-stream"):
            stream = tierd.torch.stream_parameters(
                model, device=device, device_budget_bytes=8 << 30, host_budget_bytes=0,
                socket_dir=args.socket_dir, name="bench/ds-stream")
            cleanup.append(stream.close)
        else:
            model.to(device)
        # Scratch state, as a fine-tune makes it by default (DeepSpeed's is scratch too): a
        # streamed fp32 model's weights are then their own master, and what the optimizer's
        # budget holds stays on the host between steps. Its home and budget as a user gets
        # them by default (host_budget_bytes "auto": half the host tier when the weights stream
        # through it too, else the tier's free room; at home there when the state fits).
        os.environ["TIERD_JOB"] = "bench-optimizer"
        opt = tierd.torch.OffloadedAdamW(model.parameters(), **HYPER, overlap_backward=True,
                                         socket_dir=args.socket_dir,
                                         device_share=args.device_share if mode in SPLIT else None)
        del os.environ["TIERD_JOB"]
        cleanup.insert(0, opt.close)

        def step(x):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    losses, times = [], []
    io = None
    host = 0  # the daemon's host tier in use, the most after a step
    shared = []  # the daemon's memory mapped into this process (RssShmem), after each step
    waits = []  # tierd's optimizer: what each timed step waited for its state, and its tail
    for k, x in enumerate(data):
        if k == 1:  # after the warm-up step
            io = [_io("self")] + ([_io(daemon_pid)] if daemon_pid else [])
            jobs = benchlib.job_traffic(args.socket_dir) if daemon_pid else {}
        x = x.to(device)
        t0 = time.perf_counter()
        loss = step(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().float()))
        if opt is not None and k > 0 and opt.last_stats:
            waits.append((opt.last_stats["state_wait_s"], opt.last_stats["tail_s"]))
        if probe is not None:
            host = max(host, probe.tier_usage(tierd.Tier.HOST).used_bytes)
            shared.append(benchlib.proc_status()["RssShmem"])
    after = [_io("self")] + ([_io(daemon_pid)] if daemon_pid else [])
    moved = [sum(a[i] - b[i] for a, b in zip(after, io)) for i in (0, 1)]
    by_role = {}  # tierd's: bytes a step each role's chunks moved, by path
    if daemon_pid:
        for (job, path), v in benchlib.job_traffic(args.socket_dir).items():
            role = job.removeprefix("bench-")
            by_role.setdefault(role, {})[path] = (v - jobs.get((job, path), 0.0)) / args.steps
    out = {"mode": mode, "step_s": statistics.median(times[1:]), "steps_s": times[1:],
           "losses": losses, "peak_rss": benchlib.proc_status()["VmHWM"],
           "tier_in_rss": min(shared, default=0),
           "read_bytes": moved[0] / args.steps, "written_bytes": moved[1] / args.steps,
           "host_tier_peak": host, "by_role": by_role}
    if opt is not None:  # tierd's: where the optimizer's state is at home, and its budget
        out["state"] = {"home": opt.home, "host_budget_bytes": opt.host_budget_bytes}
        if waits:
            out["state"].update(wait_s=statistics.median(w for w, _ in waits),
                                tail_s=statistics.median(t for _, t in waits))
    for close in cleanup:
        close()
    print("RESULT " + json.dumps(out), flush=True)


# ---- the parent: alternate the modes ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memlock_unlimited():  # DeepSpeed's aio pins its buffers
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY,
                                                     resource.RLIM_INFINITY))
    except (ValueError, OSError):
        pass


def run_child(args, mode, directory):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--dir", directory,
           "--init", args.init, "--live", str(args.live),
           "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
           "--layers", str(args.layers), "--heads", str(args.heads), "--vocab", str(args.vocab),
           "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
           "--dtype", args.dtype, "--device", args.device, "--build", args.build,
           "--lr", str(args.lr), "--host-capacity", args.host_capacity]
    split = mode in SPLIT
    if split:
        cmd += ["--device-share", str(args.device_share)]
    path = os.pathsep.join([os.path.join(ROOT, "python")] + [os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               LOCAL_WORLD_SIZE="1")
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"

    def launch(extra):
        r = subprocess.run(cmd + extra, capture_output=True, text=True, env=env,
                           preexec_fn=_memlock_unlimited)
        for line in r.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        text = (r.stdout + r.stderr).strip().splitlines()
        errors = [ln for ln in text if "Error" in ln or "error:" in ln]
        return {"mode": mode, "error": (errors[-1] if errors else text[-1] if text else
                                        f"exit status {r.returncode}")[:400]}
    if not mode.startswith("tierd"):  # DeepSpeed's modes, and torch's first loss
        return launch([])
    with benchlib.daemon(args.build, host_capacity=args.host_capacity, device=args.device,
                         nvme=args.nvme, emulated="1GiB" if split else "") as sock:
        got = launch(["--socket-dir", sock])
        got["daemon_peak_rss"] = benchlib.daemon_peak_rss(sock)
        return got


# How far a mode's first loss may be from torch's on the same weights and batch (relative): the
# same model code on the same weights gives the same loss; weights rounded to bf16 in an fp32
# run moved it by about 1e-6.
FIRST_LOSS_TOLERANCE = {"fp32": 1e-7, "bf16": 1e-3}


def starts_elsewhere(args, run, reference) -> str:
    """Why a run did not start from the checkpoint's weights, or ''."""
    if "error" in run or reference is None:
        return ""
    got, want = run["losses"][0], reference["loss"]
    if abs(got - want) <= FIRST_LOSS_TOLERANCE[args.dtype] * abs(want):
        return ""
    return (f"broken: its first loss {got!r} is not torch's {want!r} on the same weights and "
            "batch (it starts from other weights)")


def memory_given(args, mode, peak_rss, tier_in_rss=0) -> int:
    """The RAM a mode is given: DeepSpeed's process at its peak (its swap buffers are in it);
    tierd's trainer at its peak plus the host tier its daemon is given (--host-capacity, all of
    it, not only what the run used). The host tier's pages the trainer maps count in its RSS
    too, once they are touched: `tier_in_rss`, the least of them after any step, is counted
    once, in the tier."""
    from tierd.torch import _safetensors
    if mode.startswith("ds-"):
        return peak_rss
    return peak_rss - tier_in_rss + _safetensors.parse_size(args.host_capacity)


def report(args, runs, reference) -> None:
    from tierd.torch import _safetensors
    mib = 1 << 20
    tier_given = _safetensors.parse_size(args.host_capacity)
    modes = [m for m in args.modes.split(",") if m in runs]
    print(f"\nLlama-shaped, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
          f"{args.dtype}, batch {args.batch} x {args.seq} tokens, AdamW "
          f"{dict(HYPER, lr=args.lr)}; "
          f"{args.rounds} rounds of {args.steps} timed steps, median; torch's first loss "
          f"{reference.get('loss', reference.get('error'))}:")
    for m in modes:
        for r in runs[m]:
            why = starts_elsewhere(args, r, reference if "loss" in reference else None)
            if why:
                r["error"] = why
    ok = {m: [r for r in runs[m] if "error" not in r] for m in modes}
    first = next((m for m in modes if ok[m]), None)
    ref = statistics.median(r["step_s"] for r in ok["tierd-stream"]) \
        if ok.get("tierd-stream") else None
    def ram_of(m):  # the most any run of mode m was given
        return max(memory_given(args, m, r["peak_rss"], r.get("tier_in_rss", 0)) for r in ok[m])

    ram_ref = ram_of("tierd-stream") if ok.get("tierd-stream") else None
    for m in modes:
        if not ok[m]:
            print(f"  {m:18s} could not run here: {runs[m][0]['error']}")
            continue
        step = statistics.median(r["step_s"] for r in ok[m])
        rss = max(r["peak_rss"] for r in ok[m])
        ram = ram_of(m)
        in_rss = max(r.get("tier_in_rss", 0) for r in ok[m])
        daemon = max((r.get("daemon_peak_rss", 0) for r in ok[m]), default=0)
        host = max((r.get("host_tier_peak", 0) for r in ok[m]), default=0)
        read = statistics.median(r["read_bytes"] for r in ok[m])
        written = statistics.median(r["written_bytes"] for r in ok[m])
        diff = max(abs(a - b) / abs(b) for r in ok[m] for a, b in
                   zip(r["losses"], ok[first][0]["losses"]))
        ratio = f"{step / ref:5.2f} x tierd-stream" if ref else ""
        least = minimum_bytes(args, m)
        if least is None:
            least = ""
        else:
            least = f" (fewest {least[0] / mib:.1f} / {least[1] / mib:.1f} MiB" + (
                f": {read / least[0]:.2f} x / {written / least[1]:.2f} x)" if min(least) > 0
                else ")")
        ram_ratio = f" ({ram / ram_ref:.2f} x tierd-stream's)" if ram_ref else ""
        roles = ok[m][len(ok[m]) // 2].get("by_role") or {}
        by_role = "".join(
            f", {role} read {v.get('nvme_to_host', 0) / mib:.0f} / written "
            f"{v.get('host_to_nvme', 0) / mib:.0f} MiB" for role, v in sorted(roles.items()))
        state = ok[m][0].get("state")
        if state:
            by_role += (f", state at home on {state['home']} (host budget "
                        f"{state['host_budget_bytes'] / mib:.0f} MiB)")
            waited = [r["state"] for r in ok[m] if "wait_s" in r.get("state", {})]
            if waited:
                by_role += (f", optimizer waited "
                            f"{statistics.median(s['wait_s'] for s in waited) * 1e3:.0f} ms a "
                            f"step for its state, its tail after backward "
                            f"{statistics.median(s['tail_s'] for s in waited) * 1e3:.0f} ms")
        print(f"  {m:18s} step {step * 1e3:7.0f} ms  {ratio}   RAM {ram / mib:6.0f} MiB"
              f"{ram_ratio}: peak RSS {rss / mib:6.0f} MiB"
              + (f" (of it the tier's pages it maps {in_rss / mib:.0f} MiB)"
                 f" + host tier given {tier_given / mib:.0f} MiB (daemon's peak RSS "
                 f"{daemon / mib:.0f} MiB, {host / mib:.0f} MiB of its tier in use)"
                 if daemon else "")
              + f"   storage a step: read {read / mib:6.1f} MiB, written {written / mib:6.1f} "
              f"MiB{least}{by_role}   losses vs {first}: {diff:.1e}")
    print(json.dumps({"args": vars(args), "runs": runs}))


def main():
    args = arguments()
    if args.child == "torch":
        return first_loss(args)
    if args.child is not None:
        return child(args)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES + SPLIT]
    if unknown:
        sys.exit(f"unknown modes {unknown}: {MODES + SPLIT}")
    top = args.dir or os.path.join(args.build, "bench-tmp")
    os.makedirs(top, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="ds-side-by-side-", dir=top)
    runs = {m: [] for m in modes}
    try:
        args.init = write_init(args, directory)
        reference = run_child(args, "torch", directory)
        print(json.dumps(reference), flush=True)
        for rnd in range(args.rounds):
            for m in modes:
                got = run_child(args, m, directory)
                print(json.dumps({"round": rnd, **got}), flush=True)
                runs[m].append(got)
    finally:
        subprocess.run(["rm", "-rf", directory])
    report(args, runs, reference)


if __name__ == "__main__":
    main()
