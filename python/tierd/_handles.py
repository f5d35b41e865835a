"""What a session hands out and speaks of: the tiers and access modes, a request's Completion, a
ChunkSet, an Acquisition and the DLPack views of its chunks, and the records of a session's
figures, a tier's usage and an opened shared base. Client (client.py) makes them; each holds its
client and calls the C ABI through it.
"""
import asyncio
import ctypes
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, List, Optional, Sequence, Union

from ._errors import ViewConsumed
from . import _abi
from ._abi import TierdError, check, library

if TYPE_CHECKING:  # the annotations' only: a handle holds its client, never makes one
    from .client import Client


class Tier(enum.IntEnum):
    HOST = _abi.TIER_HOST
    NVME = _abi.TIER_NVME
    DEVICE = _abi.TIER_DEVICE


class Access(enum.IntEnum):
    READ = _abi.ACCESS_READ
    WRITE = _abi.ACCESS_WRITE
    OVERWRITE = _abi.ACCESS_OVERWRITE  # the old bytes are not wanted: nothing is fetched



def _ids(chunks: Union["ChunkSet", Iterable[int]]):
    values = list(chunks.ids if isinstance(chunks, ChunkSet) else chunks)
    return len(values), (ctypes.c_uint64 * len(values))(*values)


class Completion:
    """A request in flight (a prefetch, an evict, an acquisition's data). `wait()` blocks until it
    is done and raises if it failed; `done()` polls; `await completion` waits without blocking the
    event loop."""

    def __init__(self, client: "Client", token):
        self._client = client
        self._token = token
        self._waited = False

    def done(self) -> bool:
        if self._waited:
            return True
        status = library().tierd_poll(self._client._handle, self._token)
        if status == _abi.PENDING:
            return False
        check(status)
        return True

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until done (or `timeout` seconds: TierdError DEADLINE_EXCEEDED); raises
        TierdError if the request failed. Waiting again after success returns at once."""
        if self._waited:
            return
        ns = -1 if timeout is None else int(timeout * 1e9)
        check(library().tierd_wait(self._client._handle, self._token, ns))
        self._waited = True

    def __await__(self):
        return asyncio.get_running_loop().run_in_executor(None, self.wait).__await__()

    def stream_wait(self, stream: int) -> None:
        """Makes the CUDA stream (a `cudaStream_t` as an int, e.g. torch's
        `torch.cuda.current_stream().cuda_stream`) wait for this request on the GPU."""
        check(library().tierd_stream_wait(self._client._handle, self._token, stream))


class ChunkSet:
    """Chunks allocated together. A context manager: the chunks are freed on exit, or, where a
    DLPack tensor still views one, when the last such tensor is dropped (the memory stays the
    tensor's until then)."""

    def __init__(self, client: "Client", ids: List[int], sizes: List[int]):
        self._client = client
        self.ids = ids
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(self.ids)

    def free(self) -> None:
        """Frees the chunks now; refused (TierdError FAILED_PRECONDITION, nothing freed) while a
        tensor made from dlpack() views one of them."""
        self._free(library().tierd_free)

    def _free(self, fn) -> None:
        if self.ids and self._client._handle:
            n, ids = _ids(self.ids)
            check(fn(self._client._handle, n, ids))
        self.ids = []

    def free_deferred(self) -> None:
        """Frees the chunks now, or, where a DLPack tensor still views one, when the last such
        tensor is dropped (the memory stays the tensor's until then). Never refused for a view."""
        self._free(library().tierd_free_deferred)

    def __enter__(self) -> "ChunkSet":
        return self

    def __exit__(self, *exc) -> None:
        self.free_deferred()


# PyCapsule by hand (ctypes.pythonapi holds the GIL): the DLPack protocol hands consumers a capsule
# named "dltensor"; one that renames it has taken the tensor, and calls its deleter when done.
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
# The capsule keeps a pointer to its name: it must live as long as the module.
_DLTENSOR = ctypes.create_string_buffer(b"dltensor")


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _delete_unconsumed(capsule):
    # The capsule's address, not the object: it is being destroyed and must not be referenced.
    if _capsule_is_valid(capsule, _DLTENSOR):
        pointer = _capsule_pointer(capsule, _DLTENSOR)
        _abi.DLManagedTensor.from_address(pointer).deleter(pointer)


class DLPackView:
    """A zero-copy view of part of an acquired chunk for any DLPack consumer:
    `torch.utils.dlpack.from_dlpack(view)`, `numpy.from_dlpack(view)` (once). While the consumer's
    tensor lives, the chunk cannot be released or freed (TierdError FAILED_PRECONDITION), and
    closing the client leaves its session open until the tensor is gone."""

    def __init__(self, managed: int):
        tensor = _abi.DLManagedTensor.from_address(managed).dl_tensor
        self._device = (int(tensor.device.device_type), int(tensor.device.device_id))
        self._capsule = _capsule_new(managed, _DLTENSOR, ctypes.cast(_delete_unconsumed,
                                                                     ctypes.c_void_p))

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, stream=None):
        """The capsule; a view is consumed once."""
        if self._capsule is None:
            raise ViewConsumed("this DLPack view was already consumed")
        capsule, self._capsule = self._capsule, None
        return capsule


class Acquisition:
    """Chunks held in one tier: their addresses there, valid until released. A context manager:
    released on exit, or, where a DLPack tensor still views one, when the last such tensor is
    dropped. `ready` completes when the bytes are in place."""

    def __init__(self, client: "Client", ids: List[int], pointers: List[int], sizes: List[int],
                 ready: Completion, host: bool):
        self._client = client
        self.ids = ids
        self.pointers = pointers
        self.sizes = sizes
        self.ready = ready
        self._host = host
        self._released = False

    @property
    def host(self) -> bool:
        """Whether the chunks are held in the host tier (else in the device tier)."""
        return self._host

    def memoryview(self, i: int) -> memoryview:
        """Chunk i's bytes, without a copy (host memory only). Waits for them first."""
        if not self._host:
            raise TierdError(_abi.Status.FAILED_PRECONDITION,
                             "device-tier chunks are GPU memory: view them from the GPU")
        if self._released:
            raise TierdError(_abi.Status.FAILED_PRECONDITION, "the acquisition was released")
        self.ready.wait()
        return memoryview((ctypes.c_char * self.sizes[i]).from_address(self.pointers[i])).cast("B")

    def dlpack(self, i: int, dtype: str = "uint8", shape: Optional[Sequence[int]] = None,
               offset: int = 0) -> DLPackView:
        """A zero-copy view of chunk i's bytes from `offset` as `dtype` ("float32", "bfloat16",
        "int64", ...) of `shape` (default: as many elements as fit), for
        torch.utils.dlpack.from_dlpack or numpy.from_dlpack. Waits for the bytes first. Host
        chunks are CPU tensors; device chunks are CUDA tensors on the daemon's GPU."""
        if self._released:
            raise TierdError(_abi.Status.FAILED_PRECONDITION, "the acquisition was released")
        if dtype not in _abi.DL_TYPES:
            raise TierdError(_abi.Status.INVALID_ARGUMENT,
                             f"dtype {dtype!r} is not one of {sorted(_abi.DL_TYPES)}")
        code, bits = _abi.DL_TYPES[dtype]
        if shape is None:
            shape = [max(self.sizes[i] - offset, 0) // (bits // 8)]
        shape = [int(d) for d in shape]
        if len(shape) > _abi.DLPACK_MAX_DIMS:
            raise TierdError(_abi.Status.INVALID_ARGUMENT,
                             f"at most {_abi.DLPACK_MAX_DIMS} dimensions")
        self.ready.wait()
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        managed = ctypes.c_void_p()
        tier = _abi.TIER_HOST if self._host else _abi.TIER_DEVICE
        check(library().tierd_chunk_dlpack(self._client._handle, self.ids[i], tier, int(offset),
                                             code, bits, len(shape), dims,
                                             ctypes.byref(managed)))
        return DLPackView(managed.value)

    def release(self) -> None:
        """Releases the chunks; refused (TierdError FAILED_PRECONDITION, nothing released) while a
        tensor made from dlpack() still views one of them."""
        self._release(library().tierd_release)

    def _release(self, fn) -> None:
        if not self._released and self._client._handle:
            n, ids = _ids(self.ids)
            check(fn(self._client._handle, n, ids))
        self._released = True

    def release_deferred(self) -> None:
        """Releases the chunks now, or, where a DLPack tensor still views one, when the last such
        tensor is dropped. Never refused for a view."""
        self._release(library().tierd_release_deferred)

    def __enter__(self) -> "Acquisition":
        return self

    def __exit__(self, *exc) -> None:
        self.release_deferred()


@dataclass
class SessionStats:
    acquired_ready: int
    acquired_waited: int
    host_stall_ns: int
    device_stall_ns: int
    planner_fetches: int
    planner_drops: int
    planner_write_backs: int
    cursor: int
    schedule_steps: int
    tracing: bool


@dataclass
class TierUsage:
    tier: Tier
    configured: bool
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    largest_free_bytes: int


class OpenedBase:
    """A shared base as Client.open_base returned it: `created` when this session made it (and
    is to write its chunks and seal it), its chunk ids, sizes and home tiers, the descriptor its
    loader gave, and its creator's uid."""

    def __init__(self, name: str, info):
        self.name = name
        self.created = bool(info.created)
        self.creator_uid = int(info.creator_uid)
        n = int(info.n_chunks)
        self.ids = [int(info.ids[i]) for i in range(n)]
        self.sizes = [int(info.sizes[i]) for i in range(n)]
        self.homes = [Tier(info.homes[i]) for i in range(n)]
        self.descriptor = ctypes.string_at(info.descriptor, info.descriptor_len) \
            if info.descriptor_len else b""
