"""PyTorch on a real GPU through tierd: a daemon with the CUDA device tier, its device chunks seen by
torch without a copy, written by torch kernels, moved down to host memory and NVMe and back, and read
by a kernel enqueued behind a GPU-side stream wait.

    TIERD_BIN=... TIERD_CLIENT_LIB=... python3 tests/gpu/torch_cuda.py [--json=FILE]

Needs torch with CUDA and cupy (which hands torch a view of a raw device pointer). Exits 0 when every
check passes, 1 when one fails, 77 when the machine has no GPU.
"""
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from tierd_abi import (ACCESS_READ, ACCESS_WRITE, OK, TIER_DEVICE, TIER_HOST,  # noqa: E402
                        TIER_NVME, Completion, load_library)

CHUNK = 32 << 20
CHUNKS = 4


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def start_daemon(socket_dir):
    log = open(os.path.join(socket_dir, "daemon.log"), "w")
    proc = subprocess.Popen(
        [os.environ["TIERD_BIN"], f"--socket_dir={socket_dir}", f"--state_dir={socket_dir}/state",
         "--host_capacity=512MiB", "--host_segment_size=256MiB",
         f"--nvme_regions={socket_dir}/nvme.region:1GiB", "--device=cuda",
         "--device_capacity=1GiB", "--device_segment_size=256MiB",
         "--metrics_listen=127.0.0.1:0"],
        stdout=log, stderr=log)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(socket_dir, "tierd.sock")):
        check(proc.poll() is None, "tierd exited during start-up:\n" + open(log.name).read())
        check(time.monotonic() < deadline, "tierd did not start in 120 s")
        time.sleep(0.05)
    return proc, log.name


def main():
    import torch
    if not torch.cuda.is_available():
        print("no GPU: nothing to check")
        return 77
    import cupy

    figures = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    lib = load_library()
    with tempfile.TemporaryDirectory(prefix="tierd-torch-") as socket_dir:
        proc, log = start_daemon(socket_dir)
        try:
            handle = ctypes.c_void_p()
            check(lib.tierd_connect(socket_dir.encode(), b"torch-cuda", ctypes.byref(handle)) == OK,
                  lib.tierd_last_error())
            ordinal = ctypes.c_int(-1)
            check(lib.tierd_cuda_device(handle, ctypes.byref(ordinal)) == OK, lib.tierd_last_error())
            torch.cuda.set_device(ordinal.value)
            sizes = (ctypes.c_uint64 * CHUNKS)(*([CHUNK] * CHUNKS))
            ids = (ctypes.c_uint64 * CHUNKS)()
            check(lib.tierd_allocate(handle, CHUNKS, sizes, TIER_HOST, ids) == OK,
                  lib.tierd_last_error())
            done = Completion()

            def move(fn, tier):
                check(fn(handle, CHUNKS, ids, tier, 0, ctypes.byref(done)) == OK,
                      lib.tierd_last_error())
                check(lib.tierd_wait(handle, done, 60_000_000_000) == OK, lib.tierd_last_error())

            def views(mode):
                ptrs = (ctypes.c_void_p * CHUNKS)()
                ready = Completion()
                check(lib.tierd_acquire(handle, CHUNKS, ids, TIER_DEVICE, mode, ptrs, None,
                                        ctypes.byref(ready)) == OK, lib.tierd_last_error())
                out = []
                for p in ptrs:
                    mem = cupy.cuda.UnownedMemory(p, CHUNK, None, ordinal.value)
                    arr = cupy.ndarray((CHUNK // 4,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
                    out.append(torch.as_tensor(arr, device="cuda"))
                for t, p in zip(out, ptrs):
                    check(t.data_ptr() == p, "torch copied the chunk instead of viewing it")
                return out, ready

            move(lib.tierd_prefetch, TIER_DEVICE)
            tensors, _ = views(ACCESS_WRITE)
            torch.manual_seed(1)
            expected = []
            for t in tensors:
                t.copy_(torch.randn(t.numel(), device="cuda"))
                expected.append(t.clone())
            torch.cuda.synchronize()
            del tensors
            check(lib.tierd_release(handle, CHUNKS, ids) == OK, lib.tierd_last_error())

            # Down to the host: the CPU sees torch's bytes.
            move(lib.tierd_evict, TIER_HOST)
            ptrs = (ctypes.c_void_p * CHUNKS)()
            ready = Completion()
            check(lib.tierd_acquire(handle, CHUNKS, ids, TIER_HOST, ACCESS_READ, ptrs, None,
                                    ctypes.byref(ready)) == OK, lib.tierd_last_error())
            host = torch.frombuffer((ctypes.c_char * CHUNK).from_address(ptrs[1]),
                                    dtype=torch.float32)
            check(torch.equal(host, expected[1].cpu()), "host copy differs from the GPU's bytes")
            del host
            check(lib.tierd_release(handle, CHUNKS, ids) == OK, lib.tierd_last_error())

            # Down to NVMe, then back up with a GPU-side wait: the comparison is enqueued at once.
            move(lib.tierd_evict, TIER_NVME)
            start = time.perf_counter()
            check(lib.tierd_prefetch(handle, CHUNKS, ids, TIER_DEVICE, 0, ctypes.byref(done)) == OK,
                  lib.tierd_last_error())
            tensors, ready = views(ACCESS_READ)
            stream = torch.cuda.current_stream()
            check(lib.tierd_stream_wait(handle, ready, stream.cuda_stream) == OK,
                  lib.tierd_last_error())
            equal = [torch.equal(t, e) for t, e in zip(tensors, expected)]
            torch.cuda.synchronize()
            figures["nvme_to_gpu_gbps"] = CHUNKS * CHUNK / (time.perf_counter() - start) / 1e9
            check(all(equal), f"chunks read back after a stream wait differ: {equal}")
            check(lib.tierd_wait(handle, ready, 60_000_000_000) == OK, lib.tierd_last_error())
            del tensors
            check(lib.tierd_release(handle, CHUNKS, ids) == OK, lib.tierd_last_error())
            check(lib.tierd_free(handle, CHUNKS, ids) == OK, lib.tierd_last_error())
            lib.tierd_close(handle)
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
            print(open(log).read()[-3000:])
        check(rc == 0, f"tierd exited {rc}")
    figures["result"] = "passed"
    print(json.dumps(figures))
    for arg in sys.argv[1:]:
        if arg.startswith("--json="):
            with open(arg[len("--json="):], "w") as f:
                json.dump(figures, f)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print(f"FAILED: {e}")
        sys.exit(1)
