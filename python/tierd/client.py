"""Sessions, chunk sets, moves and acquisitions: the client library's C ABI made Pythonic. A
Client is one session; what it hands out (completions, chunk sets, acquisitions, views) is in
_handles.py.

    import tierd
    with tierd.connect() as client:
        with client.allocate([64 << 20] * 4) as chunks:
            client.prefetch(chunks, tierd.Tier.DEVICE).wait()
            with client.acquire(chunks, tierd.Tier.HOST, tierd.Access.READ) as views:
                data = views.memoryview(0)

Every call that the daemon refuses raises TierdError, carrying the gRPC status code and the
daemon's message; nothing is returned half done.
"""
import ctypes
import logging
import os
from typing import Optional, Sequence, Tuple

from . import _abi
from ._abi import TierdError, check, library
from ._handles import (Access, Acquisition, ChunkSet, Completion, DLPackView, OpenedBase,
                       SessionStats, Tier, TierUsage, _ids)

__all__ = ["Access", "Acquisition", "ChunkSet", "Client", "Completion", "DLPackView",
           "OpenedBase", "SessionStats", "Tier", "TierUsage", "TierdError", "connect"]

log = logging.getLogger(__name__)


class Client:
    """One session with the node's tierd. A context manager: closed on exit (the daemon reclaims
    every scratch chunk the session still holds)."""

    def __init__(self, socket_dir: Optional[str] = None, name: Optional[str] = None):
        name = name or "python"
        # Where the daemon is, as the library finds it: which daemon (node) the session is on.
        self.socket_dir = os.path.realpath(
            socket_dir or os.environ.get("TIERD_SOCKET_DIR") or "/run/tierd")
        self._handle = ctypes.c_void_p()
        check(library().tierd_connect(socket_dir.encode() if socket_dir else None,
                                        name.encode(), ctypes.byref(self._handle)))
        log.debug("session %d (%s) with the daemon at %s", self.session_id, name,
                  self.socket_dir)

    @property
    def session_id(self) -> int:
        return library().tierd_session_id(self._handle)

    @property
    def closed(self) -> bool:
        return not self._handle

    def close(self) -> None:
        if self._handle:
            library().tierd_close(self._handle)
            self._handle = ctypes.c_void_p()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    def allocate(self, sizes: Sequence[int], home: Tier = Tier.HOST,
                 transient: bool = False) -> ChunkSet:
        """Scratch chunks of these sizes (bytes), with a copy in `home` (HOST or NVME).
        `transient`: their contents are wanted briefly (a step's gradients), so the daemon
        writes them down only when a tier needs the room, not early while a path is idle."""
        sizes = [int(s) for s in sizes]
        if not sizes:
            raise TierdError(_abi.Status.INVALID_ARGUMENT, "allocate: no sizes given")
        arr = (ctypes.c_uint64 * len(sizes))(*sizes)
        ids = (ctypes.c_uint64 * len(sizes))()
        fn = library().tierd_allocate_transient if transient else library().tierd_allocate
        check(fn(self._handle, len(sizes), arr, int(home), ids))
        return ChunkSet(self, list(ids), sizes)

    # ---- shared bases (docs/streaming.md, "One copy per node") ----

    def open_base(self, name: str, sizes: Optional[Sequence[int]] = None,
                  homes: Optional[Sequence[Tier]] = None, descriptor: bytes = b"",
                  group: Optional[int] = None, job_writable: bool = False) -> OpenedBase:
        """Opens the node's shared base `name`, held until release_base() or the session's end.
        With `sizes` (and each chunk's home), makes it when there is none: then `created` is true
        and this session writes the chunks and calls seal_base(). `group`: a gid whose members may
        open it too (one the daemon's base_groups names, and this user's). `job_writable`: a
        base the sessions of this session's job (its ranks) open and write. TierdError
        ALREADY_EXISTS when it exists with other chunks or descriptor, UNAVAILABLE while another
        session loads it, PERMISSION_DENIED when it is not shared with this user."""
        create = None
        if sizes is not None:
            sizes = [int(s) for s in sizes]
            homes = [int(h) for h in (homes if homes is not None else [Tier.HOST] * len(sizes))]
            create = _abi.BaseCreate(len(sizes), (ctypes.c_uint64 * len(sizes))(*sizes),
                                     (ctypes.c_int * len(homes))(*homes), bytes(descriptor),
                                     len(descriptor), int(group is not None), int(group or 0),
                                     int(job_writable))
        handle = ctypes.c_void_p()
        info = _abi.BaseInfo()
        check(library().tierd_base_open(self._handle, name.encode(),
                                          ctypes.byref(create) if create is not None else None,
                                          ctypes.byref(handle), ctypes.byref(info)))
        try:
            return OpenedBase(name, info)
        finally:
            library().tierd_base_free(handle)

    def seal_base(self, name: str, descriptor: bytes = b"") -> None:
        """The base this session made is written: read-only from now on, and open to others;
        `descriptor`, when given, replaces the one it was made with."""
        check(library().tierd_base_seal(self._handle, name.encode(), bytes(descriptor),
                                          len(descriptor)))

    def release_base(self, name: str) -> None:
        """This session holds the base no longer; the base goes with its last holder unless
        pinned."""
        check(library().tierd_base_release(self._handle, name.encode()))

    def pin_base(self, name: str, pinned: bool = True) -> None:
        """Keeps a sealed base loaded after its last holder lets it go (its creator or an
        operator: PERMISSION_DENIED otherwise; FAILED_PRECONDITION before it is sealed);
        pinned=False lets it go with its last holder, at once when it has none."""
        check(library().tierd_base_pin(self._handle, name.encode(), int(pinned)))

    def prefetch(self, chunks, tier: Tier) -> Completion:
        return self._move(library().tierd_prefetch, chunks, tier)

    def evict(self, chunks, tier: Tier) -> Completion:
        return self._move(library().tierd_evict, chunks, tier)

    def discard(self, chunks) -> None:
        """The chunks' contents are dead until this session next writes them (a buffer about to
        be overwritten): the daemon drops their copies without writing them, at once where they
        are not acquired, else when it needs the room; read before then, they hold undefined
        bytes. FailedPrecondition, and nothing discarded, for a chunk acquired for write, a
        persistent one or a shared base's."""
        n, ids = _ids(chunks)
        check(library().tierd_discard(self._handle, n, ids))

    def _move(self, fn, chunks, tier: Tier) -> Completion:
        n, ids = _ids(chunks)
        token = _abi.Completion()
        check(fn(self._handle, n, ids, int(tier), 0, ctypes.byref(token)))
        return Completion(self, token)

    def acquire(self, chunks, tier: Tier, access: Access = Access.READ) -> Acquisition:
        """Holds the chunks in `tier` for `access`; their addresses are valid until released."""
        n, ids = _ids(chunks)
        pointers = (ctypes.c_void_p * n)()
        sizes = (ctypes.c_uint64 * n)()
        token = _abi.Completion()
        check(library().tierd_acquire(self._handle, n, ids, int(tier), int(access), pointers,
                                        sizes, ctypes.byref(token)))
        return Acquisition(self, list(ids), [p or 0 for p in pointers], list(sizes),
                           Completion(self, token), host=tier != Tier.DEVICE)

    def set_schedule(self, steps: Sequence[Sequence[tuple]], host_quota_bytes: int = 0,
                     device_quota_bytes: int = 0) -> None:
        """Declares one iteration's steps, repeated: step i acquires the (chunk id, tier, access)
        of steps[i] (docs/schedules.md). An access may name a pair instead, (chunk id, tier,
        access, other chunk id, version bit): the first chunk while the version bit is clear
        (set_version), the other while it is set. Replaces the session's schedule; [] clears it.
        Quotas: bytes of the host and device tiers the planner may fill for this session (0: no
        limit but the tier's)."""
        accesses = [a for step in steps for a in step]
        n = max(len(accesses), 1)
        lengths = (ctypes.c_size_t * max(len(steps), 1))(*[len(step) for step in steps])
        ids = (ctypes.c_uint64 * n)(*[int(a[0]) for a in accesses])
        tiers = (ctypes.c_int * n)(*[int(a[1]) for a in accesses])
        modes = (ctypes.c_int * n)(*[int(a[2]) for a in accesses])
        others, bits = None, None
        if any(len(a) > 3 for a in accesses):
            others = (ctypes.c_uint64 * n)(*[int(a[3]) if len(a) > 3 else 0 for a in accesses])
            bits = (ctypes.c_uint32 * n)(*[int(a[4]) if len(a) > 3 else 0 for a in accesses])
        check(library().tierd_set_paired_schedule(self._handle, len(steps), lengths, ids, others,
                                                  bits, tiers, modes, int(host_quota_bytes),
                                                  int(device_quota_bytes)))

    def trace_schedule(self, steps_per_iteration: int, host_quota_bytes: int = 0,
                       device_quota_bytes: int = 0) -> None:
        """Records this session's acquisitions over the next iteration of steps_per_iteration
        steps (filed under the step begin_step last announced) and uses them as the schedule
        from the iteration after on."""
        check(library().tierd_trace_schedule(self._handle, int(steps_per_iteration),
                                               int(host_quota_bytes), int(device_quota_bytes)))

    def begin_step(self, k: int) -> None:
        """Step k of the schedule (counting across iterations) has started: a store into shared
        memory, no call to the daemon."""
        check(library().tierd_begin_step(self._handle, int(k)))

    def set_version(self, bit: int, value: int) -> None:
        """Sets version bit `bit` (< 4096), which picks one chunk of each pair a schedule names
        with it: a store into shared memory, no call to the daemon."""
        check(library().tierd_set_version(self._handle, int(bit), int(value)))

    def stats(self) -> SessionStats:
        s = _abi.SessionStats()
        check(library().tierd_session_stats_get(self._handle, ctypes.byref(s)))
        return SessionStats(s.acquired_ready, s.acquired_waited, s.host_stall_ns,
                            s.device_stall_ns, s.planner_fetches, s.planner_drops,
                            s.planner_write_backs, s.cursor, s.schedule_steps, bool(s.tracing))

    def tier_usage(self, tier: Tier) -> TierUsage:
        u = _abi.TierUsage()
        check(library().tierd_tier_usage_get(self._handle, int(tier), ctypes.byref(u)))
        return TierUsage(Tier(tier), bool(u.configured), u.capacity_bytes, u.used_bytes,
                         u.free_bytes, u.largest_free_bytes)

    def path_bytes(self, path: str) -> int:
        """Bytes the daemon has moved over `path` since it started, all sessions together:
        "host_to_nvme", "nvme_to_host", "host_to_device" or "device_to_host"."""
        out = ctypes.c_uint64()
        check(library().tierd_path_bytes(self._handle, path.encode(), ctypes.byref(out)))
        return out.value

    def import_file(self, chunk: int, fd: int, size: int, mtime_ns: int,
                    ranges: Sequence[Tuple[int, int, int]]) -> Tuple[int, bool]:
        """Has the daemon read byte ranges of the file `fd` (regular, open for reading) into
        `chunk`, which this session holds acquired for writing in the host tier: each range is
        (file offset, chunk offset, length). `size` and `mtime_ns` are the file's as the caller
        saw them (os.fstat) when it read the file's layout; a file that is not that one, changes
        while it is read or ends early fails the import. The bytes never pass through this
        process. Returns (bytes read, whether the daemon read them with O_DIRECT)."""
        arr = (_abi.FileRange * len(ranges))(*[_abi.FileRange(*r) for r in ranges])
        got, direct = ctypes.c_uint64(), ctypes.c_int()
        check(library().tierd_import(self._handle, chunk, fd, size, mtime_ns, len(ranges), arr,
                                     ctypes.byref(got), ctypes.byref(direct)))
        return got.value, bool(direct.value)

    def cuda_device(self) -> int:
        """The daemon's GPU as this process's CUDA ordinal. From this call on, the host segments
        the session maps are registered with CUDA (page-locked), so copies between them and the
        GPU are DMA."""
        ordinal = ctypes.c_int()
        check(library().tierd_cuda_device(self._handle, ctypes.byref(ordinal)))
        return ordinal.value

    def device(self) -> dict:
        """The daemon's device tier: {"uuid", "emulated", "memory_bytes"}."""
        uuid = ctypes.create_string_buffer(64)
        emulated = ctypes.c_int()
        memory = ctypes.c_uint64()
        check(library().tierd_device_info(self._handle, uuid, 64, ctypes.byref(emulated),
                                            ctypes.byref(memory)))
        return {"uuid": uuid.value.decode(), "emulated": bool(emulated.value),
                "memory_bytes": memory.value}


def connect(socket_dir: Optional[str] = None, name: Optional[str] = None) -> Client:
    """A session with the node's daemon: `socket_dir`, else $TIERD_SOCKET_DIR, else the client
    library's default (/run/tierd). The session belongs to the job named by $TIERD_JOB, if set
    (tierctl status and the daemon's metrics attribute its chunks and traffic to it)."""
    return Client(socket_dir, name)
