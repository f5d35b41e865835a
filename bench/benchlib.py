"""What the Python benchmarks share: their command line (the example GPT's shape) and a throwaway
daemon (the build's tierd, its sockets, state and an NVMe region file (1 GiB by default) in a temporary
directory, stopped and removed on exit)."""
import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, Tuple


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def arguments(doc: str, steps: int, **defaults) -> argparse.Namespace:
    """The benchmarks' flags, parsed (`defaults` overrides the model's default shape); the build's
    client library is the one the package loads."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=steps, help="steps of each, after one warm-up")
    ap.add_argument("--block", type=int, default=4, help="steps of one before switching")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.set_defaults(**defaults)
    args = ap.parse_args()
    os.environ.setdefault("TIERD_CLIENT_LIB",
                          os.path.join(args.build, "client", "libtierd_client.so.0"))
    return args


@contextlib.contextmanager
def daemon(build: str, host_capacity: str = "512MiB", device: str = "cpu", nvme: str = "1GiB",
           emulated: str = "", device_capacity: str = ""):
    """Yields the socket directory once the daemon listens. With a CUDA `device` the daemon has
    its GPU tier (of `device_capacity`, or the daemon's default), and clients can register its
    host memory with CUDA for DMA; on the CPU, `emulated` (a capacity) gives it an emulated
    device tier."""
    backend = "cuda" if str(device).startswith("cuda") else "emulated" if emulated else "none"
    capacity = emulated if backend == "emulated" else device_capacity if backend == "cuda" else ""
    extra = [f"--device_capacity={capacity}"] if capacity else []
    root = tempfile.mkdtemp(prefix="tierd-bench-")
    log = open(os.path.join(root, "daemon.log"), "w")
    # SIGTERM when the bench's process dies, killed or not, so that no daemon outlives it
    # (util-linux's setpriv sets the signal and execs the daemon, which keeps its pid).
    dies_with_bench = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
    proc = subprocess.Popen(
        [*dies_with_bench, os.path.join(build, "daemon", "tierd"), f"--socket_dir={root}",
         f"--state_dir={root}/state", f"--host_capacity={host_capacity}", "--lock_memory=false",
         f"--nvme_regions={root}/nvme.region:{nvme}", f"--device={backend}",
         "--metrics_listen=127.0.0.1:0", *extra], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(root, "tierd.sock")):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("tierd did not start: " + open(log.name).read())
            time.sleep(0.05)
        yield root
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def proc_status(pid="self") -> Dict[str, int]:
    """A process's memory figures from /proc/PID/status, in bytes: each line given in kB (VmHWM,
    VmRSS, RssAnon, RssShmem, RssFile, ...)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields = value.split()
            if len(fields) == 2 and fields[1] == "kB":
                out[key] = int(fields[0]) * 1024
    return out


def daemon_pid(root: str) -> int:
    """The pid of the daemon whose socket directory is `root` (from its lock file)."""
    with open(os.path.join(root, "tierd.lock")) as f:
        return int(f.read().split()[0])


def daemon_peak_rss(root: str) -> int:
    """The daemon's peak resident set (VmHWM) so far, in bytes."""
    return proc_status(daemon_pid(root)).get("VmHWM", 0)


def step_minimum_bytes(weight_size: int, streamed: int, streamed_trainable: int,
                       state_params: int, memory: int = 0) -> Tuple[int, int]:
    """The fewest bytes (read, written) one AdamW training step must move between memory and
    storage: each byte of optimizer state at home on storage in once and out once; the weights at
    home there in for the forward and, where they train, out once; nothing twice that memory
    could keep. Gradients stay in memory.

    `weight_size` is the weights' element size (4 fp32, 2 bf16), `streamed` the parameters whose
    weights are at home on storage, `streamed_trainable` those of them that train, and
    `state_params` the parameters whose optimizer state is at home on storage. That state is
    exp_avg and exp_avg_sq in fp32 and, unless the weights are fp32 themselves, fp32 master
    weights: an fp32 weight is its own master, written once.

    `memory` is what the step is given to keep weights and state in (a host tier, swap buffers):
    at a step's start at most that much of what it needs is in memory, so the rest is read; at
    its end at most that much of what it changed stays there, so the rest is written. The
    backward needs every weight the forward read, and between the two at most `memory` of them
    stays: the rest is read again (weights larger than memory cannot be read once a step)."""
    state = state_params * (8 if weight_size == 4 else 12)
    weights = streamed * weight_size
    read = max(0, state + weights - memory) + max(0, weights - memory)
    written = state + streamed_trainable * weight_size
    return read, max(0, written - memory)


def llama_config(args, dtype: str, **more):
    """The benchmarks' Llama shape from their flags (--vocab, --hidden, --intermediate,
    --layers, --heads; as many key-value heads, an untied head), in `dtype` ("bfloat16",
    "float32")."""
    import transformers
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, tie_word_embeddings=False, torch_dtype=dtype, **more)


def metrics(root: str) -> str:
    """The daemon's metrics page, from its endpoint (named in its log)."""
    found = re.search(r"serving metrics on http://([^/\s]+)/metrics",
                      open(os.path.join(root, "daemon.log")).read())
    if found is None:
        sys.exit("tierd's log names no metrics endpoint")
    return urllib.request.urlopen(f"http://{found.group(1)}/metrics", timeout=10).read().decode()


def job_traffic(root: str) -> Dict[Tuple[str, str], float]:
    """Bytes each declared job's chunks moved so far, by (job, path), from the daemon's
    tierd_job_moved_bytes_total."""
    out: Dict[Tuple[str, str], float] = {}
    for m in re.finditer(r'^tierd_job_moved_bytes_total\{([^}]*)\} (\S+)$', metrics(root), re.M):
        job = re.search(r'job_name="([^"]*)"', m.group(1))
        path = re.search(r'path="([^"]*)"', m.group(1))
        if job is not None and path is not None:
            out[(job.group(1), path.group(1))] = float(m.group(2))
    return out


def requests(root: str) -> Dict[str, float]:
    """The daemon's requests so far by operation (its tierd_requests_total, every status), read
    from its metrics endpoint (named in its log)."""
    text = metrics(root)
    out: Dict[str, float] = {}
    for m in re.finditer(r'^tierd_requests_total\{([^}]*)\} (\S+)$', text, re.M):
        op = re.search(r'op="([^"]*)"', m.group(1))
        if op is not None:
            out[op.group(1)] = out.get(op.group(1), 0.0) + float(m.group(2))
    return out


# Dense bf16 peaks (TFLOPS, without sparsity) of the cards the GPU figures are measured on, by the
# name torch reports; others print no share of peak.
BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "RTX 4090": 165.2}


def model_tflops(params: int, layers: int, d_model: int, ctx: int, tokens: int,
                 seconds: float) -> float:
    """A decoder's training throughput in TFLOPS as the field counts it: 6 flops per parameter and
    token (forward and backward), plus attention's scores and weighted sums, 12 per layer, token,
    context position and model dimension (causal masking not discounted)."""
    flops = 6 * params * tokens + 12 * layers * d_model * ctx * tokens
    return flops / seconds / 1e12


def peak_share(tflops: float, device) -> str:
    """", x % of the card's bf16 peak" where the card is known, else ""."""
    import torch
    if getattr(device, "type", str(device)) != "cuda":
        return ""
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    return "" if peak is None else f", {tflops / peak * 100:.1f} % of the {name}'s bf16 peak"
