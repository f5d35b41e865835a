"""The C ABI from Python through ctypes, against a real daemon: nothing is compiled against Python.

Run by CTest with TIERD_BIN (the daemon) and TIERD_CLIENT_LIB (libtierd_client.so.N) set.
"""
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from tierd_abi import (ACCESS_OVERWRITE, ACCESS_READ, ACCESS_WRITE, FAILED_PRECONDITION,  # noqa: F401
                       INVALID_ARGUMENT, NOT_FOUND, OK, RESOURCE_EXHAUSTED, TIER_DEVICE, TIER_HOST,
                       TIER_NVME, BaseCreate, BaseInfo, Completion, SessionStats, TierUsage,
                       load_library)


def ids_array(values):
    return (ctypes.c_uint64 * len(values))(*values)


# What a test starts (a daemon, a Prometheus) ends with the test's process: it gets SIGTERM when
# the process dies, so that a test killed at its timeout leaves nothing running (util-linux's
# setpriv sets the signal and execs the command, which keeps its pid).
DIES_WITH_TEST = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []


def start_daemon(root, *flags):
    """A daemon with its sockets, state and a 96 MiB NVMe region file in `root` (its log there,
    appended to across restarts), once its socket is there. Its metrics on a port of its own: the
    default port may be a running tierd's."""
    log = open(os.path.join(root, "daemon.log"), "a")
    proc = subprocess.Popen(
        [*DIES_WITH_TEST, os.environ["TIERD_BIN"], f"--socket_dir={root}", "--host_capacity=32MiB",
         "--host_segment_size=16MiB", "--lock_memory=false", f"--state_dir={root}/state",
         f"--nvme_regions={root}/nvme.region:96MiB", "--nvme_stripe_unit=1MiB",
         "--metrics_listen=127.0.0.1:0", *flags],
        stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(root, "tierd.sock")):
        assert proc.poll() is None, open(log.name).read()
        assert time.monotonic() < deadline, "tierd did not start"
        time.sleep(0.02)
    return proc


def stop_daemon(proc, root):
    """SIGTERM, and a clean exit."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, open(os.path.join(root, "daemon.log")).read()


@pytest.fixture(scope="module")
def daemon():
    with tempfile.TemporaryDirectory(prefix="tierd-py-") as socket_dir:
        proc = start_daemon(socket_dir, "--device=emulated", "--device_capacity=32MiB",
                            "--device_segment_size=16MiB", "--metrics_listen=127.0.0.1:0")
        yield socket_dir
        stop_daemon(proc, socket_dir)


@pytest.fixture
def lib():
    return load_library()


@pytest.fixture
def client(lib, daemon):
    handle = ctypes.c_void_p()
    assert lib.tierd_connect(daemon.encode(), b"pytest", ctypes.byref(handle)) == OK, \
        lib.tierd_last_error()
    yield handle
    lib.tierd_close(handle)


def test_abi_version(lib):
    assert lib.tierd_abi_version() == 14


def test_write_through_mapping_and_read_back(lib, client):
    sizes = (ctypes.c_uint64 * 3)(4096, 1 << 20, 12345)
    ids = (ctypes.c_uint64 * 3)()
    assert lib.tierd_allocate(client, 3, sizes, TIER_HOST, ids) == OK, lib.tierd_last_error()
    ptrs = (ctypes.c_void_p * 3)()
    lens = (ctypes.c_uint64 * 3)()
    ready = Completion()
    assert lib.tierd_acquire(client, 3, ids, TIER_HOST, ACCESS_WRITE, ptrs, lens,
                             ctypes.byref(ready)) == OK
    assert lib.tierd_poll(client, ready) == OK
    assert lib.tierd_wait(client, ready, 0) == OK
    for i in range(3):
        assert lens[i] >= sizes[i]
        ctypes.memset(ptrs[i], 0x41 + i, sizes[i])
    assert lib.tierd_release(client, 3, ids) == OK

    assert lib.tierd_acquire(client, 3, ids, TIER_HOST, ACCESS_READ, ptrs, None,
                             ctypes.byref(ready)) == OK
    for i in range(3):
        data = ctypes.string_at(ptrs[i], sizes[i])
        assert data == bytes([0x41 + i]) * sizes[i]
    assert lib.tierd_release(client, 3, ids) == OK
    assert lib.tierd_free(client, 3, ids) == OK


def test_errors_have_codes_and_messages(lib, client):
    sizes = (ctypes.c_uint64 * 1)(0)
    ids = (ctypes.c_uint64 * 1)()
    assert lib.tierd_allocate(client, 1, sizes, TIER_HOST, ids) == INVALID_ARGUMENT
    assert b"size 0" in lib.tierd_last_error()
    assert lib.tierd_free(client, 1, ids_array([987654])) == NOT_FOUND
    assert b"chunk 987654" in lib.tierd_last_error()
    assert lib.tierd_allocate(None, 1, sizes, TIER_HOST, ids) == INVALID_ARGUMENT
    c = Completion()
    assert lib.tierd_prefetch(client, 1, ids_array([1]), TIER_NVME, 0, ctypes.byref(c)) in (
        NOT_FOUND, FAILED_PRECONDITION)


def test_tier_full_then_usage_unchanged(lib, client):
    before = TierUsage()
    assert lib.tierd_tier_usage_get(client, TIER_HOST, ctypes.byref(before)) == OK
    assert before.configured == 1 and before.capacity_bytes == 32 << 20
    sizes = (ctypes.c_uint64 * 3)(16 << 20, 16 << 20, 16 << 20)
    ids = (ctypes.c_uint64 * 3)()
    assert lib.tierd_allocate(client, 3, sizes, TIER_HOST, ids) == RESOURCE_EXHAUSTED
    assert b"host tier full" in lib.tierd_last_error()
    after = TierUsage()
    assert lib.tierd_tier_usage_get(client, TIER_HOST, ctypes.byref(after)) == OK
    assert after.used_bytes == before.used_bytes


def test_persistent_named_chunk_reopens_in_a_new_session(lib, daemon):
    first = ctypes.c_void_p()
    assert lib.tierd_connect(daemon.encode(), b"first", ctypes.byref(first)) == OK
    cid = ctypes.c_uint64()
    assert lib.tierd_allocate_named(first, b"pyjob/opt/v/0", 8192, TIER_HOST, 1, 0,
                                    ctypes.byref(cid)) == OK, lib.tierd_last_error()
    lib.tierd_close(first)
    second = ctypes.c_void_p()
    assert lib.tierd_connect(daemon.encode(), b"second", ctypes.byref(second)) == OK
    again = ctypes.c_uint64()
    assert lib.tierd_allocate_named(second, b"pyjob/opt/v/0", 8192, TIER_HOST, 1, 1,
                                    ctypes.byref(again)) == OK, lib.tierd_last_error()
    assert again.value == cid.value
    count = ctypes.c_uint64()
    assert lib.tierd_chunk_count(second, ctypes.byref(count)) == OK and count.value >= 1
    assert lib.tierd_free(second, 1, ids_array([again.value])) == OK
    lib.tierd_close(second)


def test_named_state_has_an_owner(lib, daemon):
    open_existing, must_exist, shared = 1, 2, 4
    first, second = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.tierd_connect(daemon.encode(), b"job-a", ctypes.byref(first)) == OK
    assert lib.tierd_connect(daemon.encode(), b"job-b", ctypes.byref(second)) == OK
    cid, other = ctypes.c_uint64(), ctypes.c_uint64()
    # A resume of a name that was never made (a typo) is NOT_FOUND, not a fresh zeroed chunk.
    assert lib.tierd_allocate_named(first, b"pyjob/typo", 4096, TIER_HOST, 1,
                                    open_existing | must_exist, ctypes.byref(cid)) == NOT_FOUND
    assert b"pyjob/typo" in lib.tierd_last_error()
    assert lib.tierd_allocate_named(first, b"pyjob/adam", 4096, TIER_HOST, 1, 0,
                                    ctypes.byref(cid)) == OK, lib.tierd_last_error()
    # Job B of the same user, with the same name, while job A lives: refused, naming job A.
    assert lib.tierd_allocate_named(second, b"pyjob/adam", 4096, TIER_HOST, 1,
                                    open_existing | must_exist,
                                    ctypes.byref(other)) == FAILED_PRECONDITION
    error = lib.tierd_last_error()
    assert b"job-a" in error and f"pid {os.getpid()}".encode() in error, error
    # Nor can B reset it by freeing it.
    assert lib.tierd_free(second, 1, ids_array([cid.value])) == FAILED_PRECONDITION
    # Unknown flags are refused.
    assert lib.tierd_allocate_named(second, b"pyjob/adam", 4096, TIER_HOST, 1, 8,
                                    ctypes.byref(other)) == INVALID_ARGUMENT
    lib.tierd_close(first)
    assert lib.tierd_allocate_named(second, b"pyjob/adam", 4096, TIER_HOST, 1,
                                    open_existing | must_exist | shared,
                                    ctypes.byref(other)) == OK, lib.tierd_last_error()
    assert other.value == cid.value
    assert lib.tierd_free(second, 1, ids_array([cid.value])) == OK
    lib.tierd_close(second)


def write_and_evict(lib, client, ids, sizes, values):
    """Fills each chunk's host copy with one byte value, then moves the chunks to NVMe."""
    n = len(values)
    ptrs = (ctypes.c_void_p * n)()
    ready = Completion()
    assert lib.tierd_acquire(client, n, ids, TIER_HOST, ACCESS_WRITE, ptrs, None,
                             ctypes.byref(ready)) == OK, lib.tierd_last_error()
    assert lib.tierd_wait(client, ready, 10_000_000_000) == OK, lib.tierd_last_error()
    for i in range(n):
        ctypes.memset(ptrs[i], values[i], sizes[i])
    assert lib.tierd_release(client, n, ids) == OK
    done = Completion()
    assert lib.tierd_evict(client, n, ids, TIER_NVME, 0, ctypes.byref(done)) == OK, \
        lib.tierd_last_error()
    assert lib.tierd_wait(client, done, 10_000_000_000) == OK, lib.tierd_last_error()


def test_evict_to_nvme_and_prefetch_back(lib, client):
    sizes = (ctypes.c_uint64 * 2)(3 << 20, 12345)
    ids = (ctypes.c_uint64 * 2)()
    assert lib.tierd_allocate(client, 2, sizes, TIER_HOST, ids) == OK
    write_and_evict(lib, client, ids, sizes, [0x61, 0x62])
    ptrs = (ctypes.c_void_p * 2)()
    ready = Completion()
    # The host copies are gone: acquiring there brings them back; the token says when.
    assert lib.tierd_acquire(client, 2, ids, TIER_HOST, ACCESS_READ, ptrs, None,
                             ctypes.byref(ready)) == OK
    assert lib.tierd_wait(client, ready, 10_000_000_000) == OK, lib.tierd_last_error()
    for i in range(2):
        assert ctypes.string_at(ptrs[i], sizes[i]) == bytes([0x61 + i]) * sizes[i]
    assert lib.tierd_release(client, 2, ids) == OK
    assert lib.tierd_free(client, 2, ids) == OK


def test_discard_drops_a_copy_unwritten_and_refuses_one_being_written(lib, client):
    sizes = (ctypes.c_uint64 * 1)(1 << 20)
    ids = (ctypes.c_uint64 * 1)()
    assert lib.tierd_allocate(client, 1, sizes, TIER_HOST, ids) == OK
    write_and_evict(lib, client, ids, sizes, [0x31])  # it has space on NVMe
    ptrs = (ctypes.c_void_p * 1)()
    ready = Completion()
    assert lib.tierd_acquire(client, 1, ids, TIER_HOST, ACCESS_OVERWRITE, ptrs, None,
                             ctypes.byref(ready)) == OK, lib.tierd_last_error()
    ctypes.memset(ptrs[0], 0x32, sizes[0])
    # Acquired for write: its writer may be writing now, so it is refused, and nothing changes.
    assert lib.tierd_discard(client, 1, ids) == FAILED_PRECONDITION
    assert b"acquired for write" in lib.tierd_last_error()
    assert lib.tierd_release(client, 1, ids) == OK
    written = ctypes.c_uint64()
    assert lib.tierd_path_bytes(client, b"host_to_nvme", ctypes.byref(written)) == OK
    # Its new contents declared dead: sent down, nothing is written.
    assert lib.tierd_discard(client, 1, ids) == OK, lib.tierd_last_error()
    done = Completion()
    assert lib.tierd_evict(client, 1, ids, TIER_NVME, 0, ctypes.byref(done)) == OK
    assert lib.tierd_wait(client, done, 10_000_000_000) == OK
    after = ctypes.c_uint64()
    assert lib.tierd_path_bytes(client, b"host_to_nvme", ctypes.byref(after)) == OK
    assert after.value == written.value
    assert lib.tierd_discard(client, 1, None) == INVALID_ARGUMENT
    assert lib.tierd_free(client, 1, ids) == OK


def test_overwrite_fetches_nothing_and_bad_modes_are_refused(lib, client):
    sizes = (ctypes.c_uint64 * 1)(1 << 20)
    ids = (ctypes.c_uint64 * 1)()
    assert lib.tierd_allocate(client, 1, sizes, TIER_HOST, ids) == OK
    write_and_evict(lib, client, ids, sizes, [0x11])
    ptrs = (ctypes.c_void_p * 1)()
    ready = Completion()
    # Overwritten from scratch: ready at once, no read of the old contents.
    assert lib.tierd_acquire(client, 1, ids, TIER_HOST, ACCESS_OVERWRITE, ptrs, None,
                             ctypes.byref(ready)) == OK, lib.tierd_last_error()
    assert lib.tierd_poll(client, ready) == OK
    ctypes.memset(ptrs[0], 0x22, sizes[0])
    assert lib.tierd_release(client, 1, ids) == OK
    assert lib.tierd_acquire(client, 1, ids, TIER_HOST, ACCESS_READ, ptrs, None,
                             ctypes.byref(ready)) == OK
    assert lib.tierd_wait(client, ready, 10_000_000_000) == OK
    assert ctypes.string_at(ptrs[0], sizes[0]) == b"\x22" * sizes[0]
    assert lib.tierd_release(client, 1, ids) == OK
    # A mode that is none of the three: refused, nothing pinned.
    assert lib.tierd_acquire(client, 1, ids, TIER_HOST, 4, ptrs, None,
                             ctypes.byref(ready)) == INVALID_ARGUMENT
    assert b"ACCESS_MODE_OVERWRITE" in lib.tierd_last_error()
    assert lib.tierd_free(client, 1, ids) == OK


def test_device_tier_pointers_from_python(lib, client):
    uuid = ctypes.create_string_buffer(64)
    emulated = ctypes.c_int()
    memory = ctypes.c_uint64()
    assert lib.tierd_device_info(client, uuid, 64, ctypes.byref(emulated), ctypes.byref(memory)) \
        == OK, lib.tierd_last_error()
    assert uuid.value.startswith(b"GPU-") and emulated.value == 1 and memory.value > 0
    sizes = (ctypes.c_uint64 * 1)(1 << 20)
    ids = (ctypes.c_uint64 * 1)()
    assert lib.tierd_allocate(client, 1, sizes, TIER_HOST, ids) == OK
    done = Completion()
    assert lib.tierd_prefetch(client, 1, ids, TIER_DEVICE, 0, ctypes.byref(done)) == OK
    assert lib.tierd_wait(client, done, 10_000_000_000) == OK, lib.tierd_last_error()
    ptrs = (ctypes.c_void_p * 1)()
    ready = Completion()
    assert lib.tierd_acquire(client, 1, ids, TIER_DEVICE, ACCESS_WRITE, ptrs, None,
                             ctypes.byref(ready)) == OK
    # The emulated device's memory is host memory: Python can write the "GPU" copy directly.
    ctypes.memset(ptrs[0], 0x7E, 1 << 20)
    assert lib.tierd_release(client, 1, ids) == OK
    assert lib.tierd_evict(client, 1, ids, TIER_HOST, 0, ctypes.byref(done)) == OK
    assert lib.tierd_wait(client, done, 10_000_000_000) == OK, lib.tierd_last_error()
    assert lib.tierd_acquire(client, 1, ids, TIER_HOST, ACCESS_READ, ptrs, None,
                             ctypes.byref(ready)) == OK
    assert ctypes.string_at(ptrs[0], 1 << 20) == b"\x7e" * (1 << 20)
    assert lib.tierd_release(client, 1, ids) == OK
    assert lib.tierd_free(client, 1, ids) == OK


def test_emulated_device_has_no_cuda_ordinal_or_stream_waits(lib, client):
    ordinal = ctypes.c_int(-1)
    assert lib.tierd_cuda_device(client, ctypes.byref(ordinal)) == FAILED_PRECONDITION
    assert b"emulated" in lib.tierd_last_error()
    assert ordinal.value == -1
    sizes = (ctypes.c_uint64 * 1)(1 << 20)
    ids = (ctypes.c_uint64 * 1)()
    assert lib.tierd_allocate(client, 1, sizes, TIER_HOST, ids) == OK
    done = Completion()
    assert lib.tierd_prefetch(client, 1, ids, TIER_DEVICE, 0, ctypes.byref(done)) == OK
    assert lib.tierd_stream_wait(client, done, 0) == FAILED_PRECONDITION
    assert lib.tierd_wait(client, done, 10_000_000_000) == OK, lib.tierd_last_error()
    assert lib.tierd_free(client, 1, ids) == OK


def session_stats(lib, client):
    stats = SessionStats()
    assert lib.tierd_session_stats_get(client, ctypes.byref(stats)) == OK, lib.tierd_last_error()
    return stats


def test_schedule_cursor_and_stats(lib, client):
    n = 4
    sizes = (ctypes.c_uint64 * n)(*([4 << 20] * n))
    ids = (ctypes.c_uint64 * n)()
    assert lib.tierd_allocate(client, n, sizes, TIER_NVME, ids) == OK, lib.tierd_last_error()
    # Step i reads chunk i on the host; the last step also writes chunk 0.
    lengths = (ctypes.c_size_t * n)(1, 1, 1, 2)
    flat = (ctypes.c_uint64 * 5)(ids[0], ids[1], ids[2], ids[3], ids[0])
    tiers = (ctypes.c_int * 5)(*([TIER_HOST] * 5))
    modes = (ctypes.c_int * 5)(ACCESS_READ, ACCESS_READ, ACCESS_READ, ACCESS_READ, ACCESS_WRITE)
    assert lib.tierd_set_schedule(client, n, lengths, flat, tiers, modes, 0, 0) == OK, \
        lib.tierd_last_error()
    stats = session_stats(lib, client)
    assert stats.schedule_steps == n and stats.tracing == 0
    ptr = (ctypes.c_void_p * 1)()
    ready = Completion()
    for k in range(2 * n):  # two iterations, through the cursor
        assert lib.tierd_begin_step(client, k) == OK
        one = ids_array([ids[k % n]])
        assert lib.tierd_acquire(client, 1, one, TIER_HOST, ACCESS_READ, ptr, None,
                                 ctypes.byref(ready)) == OK, lib.tierd_last_error()
        assert lib.tierd_wait(client, ready, 10_000_000_000) == OK, lib.tierd_last_error()
        assert lib.tierd_release(client, 1, one) == OK
        time.sleep(0.01)
    time.sleep(0.05)  # a few planning rounds: the daemon has read the cursor
    stats = session_stats(lib, client)
    assert stats.cursor == 2 * n
    assert stats.acquired_ready + stats.acquired_waited == 2 * n
    # A bad access is refused before anything is sent; the schedule in force stays.
    bad_tiers = (ctypes.c_int * 5)(TIER_HOST, 7, TIER_HOST, TIER_HOST, TIER_HOST)
    assert lib.tierd_set_schedule(client, n, lengths, flat, bad_tiers, modes, 0, 0) == \
        INVALID_ARGUMENT
    assert b"names tier 7" in lib.tierd_last_error()
    nvme_tiers = (ctypes.c_int * 5)(*([TIER_NVME] * 5))
    assert lib.tierd_set_schedule(client, n, lengths, flat, nvme_tiers, modes, 0, 0) == \
        INVALID_ARGUMENT
    assert session_stats(lib, client).schedule_steps == n
    # Trace mode replaces it; zero steps clears everything.
    assert lib.tierd_trace_schedule(client, n, 0, 0) == OK, lib.tierd_last_error()
    stats = session_stats(lib, client)
    assert stats.tracing == 1 and stats.schedule_steps == 0
    assert lib.tierd_trace_schedule(client, 0, 0, 0) == INVALID_ARGUMENT
    assert lib.tierd_set_schedule(client, 0, None, None, None, None, 0, 0) == OK
    stats = session_stats(lib, client)
    assert stats.tracing == 0 and stats.schedule_steps == 0
    assert lib.tierd_free(client, n, ids) == OK


def test_bandwidth_weight_within_the_daemons_limit(lib, client):
    assert lib.tierd_set_bandwidth_weight(client, 8) == OK, lib.tierd_last_error()
    assert lib.tierd_set_bandwidth_weight(client, 0) == INVALID_ARGUMENT
    assert b"between 1 and 16" in lib.tierd_last_error()
    assert lib.tierd_set_bandwidth_weight(None, 1) == INVALID_ARGUMENT


def test_shared_base_calls_refuse_bad_arguments_and_change_nothing(lib, client):
    base, info = ctypes.c_void_p(), BaseInfo()
    sizes, homes = (ctypes.c_uint64 * 1)(4096), (ctypes.c_int * 1)(TIER_HOST)
    assert lib.tierd_base_open(None, b"b", None, ctypes.byref(base), ctypes.byref(info)) == \
        INVALID_ARGUMENT
    assert lib.tierd_base_open(client, None, None, ctypes.byref(base), ctypes.byref(info)) == \
        INVALID_ARGUMENT
    no_sizes = BaseCreate(1, None, homes, None, 0, 0, 0)
    assert lib.tierd_base_open(client, b"b", ctypes.byref(no_sizes), ctypes.byref(base),
                               ctypes.byref(info)) == INVALID_ARGUMENT
    no_descriptor = BaseCreate(1, sizes, homes, None, 5, 0, 0)
    assert lib.tierd_base_open(client, b"b", ctypes.byref(no_descriptor), ctypes.byref(base),
                               ctypes.byref(info)) == INVALID_ARGUMENT
    bad_name = BaseCreate(1, sizes, homes, None, 0, 0, 0)
    assert lib.tierd_base_open(client, b"a//b", ctypes.byref(bad_name), ctypes.byref(base),
                               ctypes.byref(info)) == INVALID_ARGUMENT
    assert lib.tierd_base_open(client, b"b", None, ctypes.byref(base), ctypes.byref(info)) == \
        NOT_FOUND
    assert lib.tierd_base_seal(client, b"b", None, 3) == INVALID_ARGUMENT
    assert lib.tierd_base_seal(client, b"b", None, 0) == NOT_FOUND
    assert lib.tierd_base_release(None, b"b") == INVALID_ARGUMENT
    assert lib.tierd_base_pin(client, b"b", 1) == NOT_FOUND
    lib.tierd_base_free(None)  # nothing to free
