"""The C ABI (client/include/tierd/client.h) for ctypes: constants, structures, signatures, the
library's loading, and its refusals raised as TierdError (_errors.py).

Nothing here is compiled against Python, so the package works with any Python >= 3.9.
"""
import ctypes
import os

from ._errors import MissingDependency, Status, TierdError  # noqa: F401 (the ABI's)

LIBRARY = "libtierd_client.so.0"

TIER_HOST, TIER_NVME, TIER_DEVICE = 1, 2, 3
ACCESS_READ, ACCESS_WRITE, ACCESS_OVERWRITE = 1, 2, 3
VERSION_BITS = 4096  # TIERD_VERSION_BITS: the version bits a schedule's pairs may name

OK, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, FAILED_PRECONDITION = (
    Status.OK, Status.INVALID_ARGUMENT, Status.NOT_FOUND, Status.RESOURCE_EXHAUSTED,
    Status.FAILED_PRECONDITION)
PENDING = 100  # TIERD_PENDING: tierd_poll's "not yet", not an error


class BaseCreate(ctypes.Structure):
    _fields_ = [("n_chunks", ctypes.c_size_t), ("sizes", ctypes.POINTER(ctypes.c_uint64)),
                ("homes", ctypes.POINTER(ctypes.c_int)), ("descriptor", ctypes.c_char_p),
                ("descriptor_len", ctypes.c_size_t), ("share_with_group", ctypes.c_int),
                ("group", ctypes.c_uint32), ("job_writable", ctypes.c_int)]


class BaseInfo(ctypes.Structure):
    _fields_ = [("created", ctypes.c_int), ("creator_uid", ctypes.c_uint32),
                ("n_chunks", ctypes.c_size_t), ("ids", ctypes.POINTER(ctypes.c_uint64)),
                ("sizes", ctypes.POINTER(ctypes.c_uint64)), ("homes", ctypes.POINTER(ctypes.c_int)),
                ("descriptor", ctypes.c_void_p), ("descriptor_len", ctypes.c_size_t)]


class Completion(ctypes.Structure):
    _fields_ = [("slot", ctypes.c_uint32), ("sequence", ctypes.c_uint32)]


class FileRange(ctypes.Structure):
    _fields_ = [("file_offset", ctypes.c_uint64), ("chunk_offset", ctypes.c_uint64),
                ("length", ctypes.c_uint64)]


class TierUsage(ctypes.Structure):
    _fields_ = [("configured", ctypes.c_int32), ("capacity_bytes", ctypes.c_uint64),
                ("used_bytes", ctypes.c_uint64), ("free_bytes", ctypes.c_uint64),
                ("largest_free_bytes", ctypes.c_uint64)]


class SessionStats(ctypes.Structure):
    _fields_ = [("acquired_ready", ctypes.c_uint64), ("acquired_waited", ctypes.c_uint64),
                ("host_stall_ns", ctypes.c_uint64), ("device_stall_ns", ctypes.c_uint64),
                ("planner_fetches", ctypes.c_uint64), ("planner_drops", ctypes.c_uint64),
                ("planner_write_backs", ctypes.c_uint64), ("cursor", ctypes.c_uint64),
                ("schedule_steps", ctypes.c_uint32), ("tracing", ctypes.c_int32)]


FLOAT32, BFLOAT16, FLOAT16 = 0, 1, 2
ADAM_PARAMS, ADAM_M, ADAM_V = 0, 1, 2


class AdamHyper(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("adamw", ctypes.c_int32)]


class AdamOptions(ctypes.Structure):
    _fields_ = [("socket_dir", ctypes.c_char_p), ("name", ctypes.c_char_p),
                ("home_tier", ctypes.c_int32), ("persistent", ctypes.c_int32),
                ("reset", ctypes.c_int32), ("threads", ctypes.c_int32),
                ("check_finite", ctypes.c_int32), ("host_budget_bytes", ctypes.c_uint64),
                ("shard_params", ctypes.c_uint64), ("hyper", AdamHyper),
                ("open_mode", ctypes.c_int32), ("state_dtype", ctypes.c_int32),
                ("speculative", ctypes.c_int32), ("device_budget_bytes", ctypes.c_uint64)]


ADAM_CREATE_OR_OPEN, ADAM_CREATE, ADAM_OPEN = 0, 1, 2
# Flags per tensor of tierd_adam_step_tensors: stepped (it has a gradient); master weights taken.
ADAM_TENSOR_STEP, ADAM_TENSOR_TAKE_WEIGHTS = 1, 2
ADAM_ON_HOST, ADAM_ON_DEVICE = 0, 1  # where a group is stepped (tierd_adam_set_group_place)


# Where a group's fp32 master weights live (tierd_adam_group.master): in the state, or in the fp32
# `out` each step is given (the state holds m and v only).
ADAM_MASTER_IN_STATE, ADAM_MASTER_IN_OUT = 0, 1


class AdamGroup(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("params", ctypes.c_uint64),
                ("n_tensors", ctypes.c_size_t),
                ("tensor_params", ctypes.POINTER(ctypes.c_uint64)), ("master", ctypes.c_int32)]


class AdamStepStats(ctypes.Structure):
    _fields_ = [("step", ctypes.c_int64), ("wall_ns", ctypes.c_uint64),
                ("compute_ns", ctypes.c_uint64), ("state_wait_ns", ctypes.c_uint64),
                ("write_wait_ns", ctypes.c_uint64), ("state_bytes", ctypes.c_uint64),
                ("skipped_groups", ctypes.c_uint32)]


class AdamLanes(ctypes.Structure):
    """tierd_adam_lanes: the last step's host and device lanes."""
    _fields_ = [("host_params", ctypes.c_uint64), ("host_ns", ctypes.c_uint64),
                ("device_params", ctypes.c_uint64), ("device_ns", ctypes.c_uint64),
                ("share", ctypes.c_double), ("device_kept_bytes", ctypes.c_uint64)]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.CFUNCTYPE(None, ctypes.c_void_p))]


# DLPack type codes (dlpack.h) and the dtypes the views take, by numpy/torch name.
DL_INT, DL_UINT, DL_FLOAT, DL_BFLOAT = 0, 1, 2, 4
DL_CPU, DL_CUDA = 1, 2
DL_TYPES = {
    "float32": (DL_FLOAT, 32), "float16": (DL_FLOAT, 16), "float64": (DL_FLOAT, 64),
    "bfloat16": (DL_BFLOAT, 16), "int8": (DL_INT, 8), "int16": (DL_INT, 16),
    "int32": (DL_INT, 32), "int64": (DL_INT, 64), "uint8": (DL_UINT, 8),
    "uint16": (DL_UINT, 16), "uint32": (DL_UINT, 32), "uint64": (DL_UINT, 64),
}
DLPACK_MAX_DIMS = 16


def library_path():
    """Where libtierd_client.so.0 is: $TIERD_CLIENT_LIB, beside this package, the source tree's
    build/ (when the package is used from a checkout), else the name for the dynamic loader's own
    search (an installed library)."""
    if os.environ.get("TIERD_CLIENT_LIB"):
        return os.environ["TIERD_CLIENT_LIB"]
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, LIBRARY),
                      os.path.join(here, "..", "..", "build", "client", LIBRARY)):
        if os.path.exists(candidate):
            return os.path.normpath(candidate)
    return LIBRARY


# The C ABI these declarations describe (TIERD_C_ABI_VERSION): an older library lays out
# structures such as AdamOptions differently, so it is refused rather than misread.
ABI_VERSION = 14


def load_library():
    path = library_path()
    lib = ctypes.CDLL(path)
    lib.tierd_abi_version.restype = ctypes.c_int
    found = lib.tierd_abi_version()
    if found != ABI_VERSION:
        raise MissingDependency(f"{path} implements the tierd C ABI version {found}; this package "
                                f"needs version {ABI_VERSION}: install the library and the package "
                                "of one release")
    p = ctypes.c_void_p
    u64p = ctypes.POINTER(ctypes.c_uint64)
    lib.tierd_last_error.restype = ctypes.c_char_p
    lib.tierd_connect.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(p)]
    lib.tierd_close.argtypes = [p]
    lib.tierd_session_id.argtypes = [p]
    lib.tierd_session_id.restype = ctypes.c_uint64
    lib.tierd_allocate.argtypes = [p, ctypes.c_size_t, u64p, ctypes.c_int, u64p]
    lib.tierd_allocate_transient.argtypes = [p, ctypes.c_size_t, u64p, ctypes.c_int, u64p]
    lib.tierd_allocate_named.argtypes = [p, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_int, u64p]
    lib.tierd_free.argtypes = [p, ctypes.c_size_t, u64p]
    lib.tierd_acquire.argtypes = [p, ctypes.c_size_t, u64p, ctypes.c_int, ctypes.c_int,
                                  ctypes.POINTER(p), u64p, ctypes.POINTER(Completion)]
    lib.tierd_release.argtypes = [p, ctypes.c_size_t, u64p]
    lib.tierd_release_deferred.argtypes = [p, ctypes.c_size_t, u64p]
    lib.tierd_free_deferred.argtypes = [p, ctypes.c_size_t, u64p]
    lib.tierd_prefetch.argtypes = [p, ctypes.c_size_t, u64p, ctypes.c_int, ctypes.c_int,
                                   ctypes.POINTER(Completion)]
    lib.tierd_evict.argtypes = [p, ctypes.c_size_t, u64p, ctypes.c_int, ctypes.c_int,
                                ctypes.POINTER(Completion)]
    lib.tierd_discard.argtypes = [p, ctypes.c_size_t, u64p]
    lib.tierd_poll.argtypes = [p, Completion]
    lib.tierd_wait.argtypes = [p, Completion, ctypes.c_int64]
    lib.tierd_tier_usage_get.argtypes = [p, ctypes.c_int, ctypes.POINTER(TierUsage)]
    lib.tierd_chunk_count.argtypes = [p, u64p]
    lib.tierd_path_bytes.argtypes = [p, ctypes.c_char_p, u64p]
    lib.tierd_import.argtypes = [p, ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64,
                                 ctypes.c_int64, ctypes.c_size_t, ctypes.POINTER(FileRange), u64p,
                                 ctypes.POINTER(ctypes.c_int)]
    lib.tierd_device_info.argtypes = [p, ctypes.c_char_p, ctypes.c_size_t,
                                      ctypes.POINTER(ctypes.c_int), u64p]
    lib.tierd_cuda_device.argtypes = [p, ctypes.POINTER(ctypes.c_int)]
    lib.tierd_stream_wait.argtypes = [p, Completion, ctypes.c_uint64]
    intp = ctypes.POINTER(ctypes.c_int)
    lib.tierd_set_schedule.argtypes = [p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), u64p,
                                       intp, intp, ctypes.c_uint64, ctypes.c_uint64]
    lib.tierd_trace_schedule.argtypes = [p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64]
    lib.tierd_set_paired_schedule.argtypes = [
        p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), u64p, u64p,
        ctypes.POINTER(ctypes.c_uint32), intp, intp, ctypes.c_uint64, ctypes.c_uint64]
    lib.tierd_begin_step.argtypes = [p, ctypes.c_uint64]
    lib.tierd_set_version.argtypes = [p, ctypes.c_uint32, ctypes.c_int]
    lib.tierd_session_stats_get.argtypes = [p, ctypes.POINTER(SessionStats)]
    lib.tierd_set_bandwidth_weight.argtypes = [p, ctypes.c_uint32]
    lib.tierd_base_open.argtypes = [p, ctypes.c_char_p, ctypes.POINTER(BaseCreate),
                                    ctypes.POINTER(p), ctypes.POINTER(BaseInfo)]
    lib.tierd_base_free.argtypes = [p]
    lib.tierd_base_free.restype = None
    lib.tierd_base_seal.argtypes = [p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.tierd_base_release.argtypes = [p, ctypes.c_char_p]
    lib.tierd_base_pin.argtypes = [p, ctypes.c_char_p, ctypes.c_int]
    lib.tierd_chunk_dlpack.argtypes = [p, ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64,
                                       ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                       ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(p)]
    _bind_optimizer(lib)
    return lib


def _bind_optimizer(lib):
    p, u64, fp = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p
    lib.tierd_cpu_adam_step.argtypes = [fp, fp, fp, p, ctypes.c_int, p, ctypes.c_int, u64,
                                        ctypes.POINTER(AdamHyper), ctypes.c_float,
                                        ctypes.c_int64, ctypes.c_int]
    lib.tierd_adam_options_init.argtypes = [ctypes.POINTER(AdamOptions)]
    lib.tierd_adam_create.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p),
                                      ctypes.POINTER(u64), ctypes.POINTER(AdamOptions),
                                      ctypes.POINTER(p)]
    groups = ctypes.POINTER(AdamGroup)
    lib.tierd_adam_create_groups.argtypes = [ctypes.c_size_t, groups, ctypes.POINTER(AdamOptions),
                                             ctypes.POINTER(p)]
    lib.tierd_adam_add_groups.argtypes = [p, ctypes.c_size_t, groups]
    lib.tierd_adam_remove_groups.argtypes = [p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    lib.tierd_adam_group_count.argtypes = [p]
    lib.tierd_adam_group_count.restype = ctypes.c_size_t
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.tierd_adam_get_tensor_steps.argtypes = [p, ctypes.c_size_t, i64p, ctypes.c_size_t]
    lib.tierd_adam_set_tensor_steps.argtypes = [p, ctypes.c_size_t, i64p, ctypes.c_size_t]
    lib.tierd_adam_step_tensors.argtypes = [p, ctypes.c_size_t, p, ctypes.c_int, p, ctypes.c_int,
                                            ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t, fp]
    lib.tierd_adam_destroy.argtypes = [p]
    lib.tierd_adam_resumed.argtypes = [p]
    lib.tierd_adam_steps_taken.argtypes = [p]
    lib.tierd_adam_steps_taken.restype = ctypes.c_int64
    lib.tierd_adam_initialized.argtypes = [p, ctypes.c_size_t]
    lib.tierd_adam_state_bytes.argtypes = [p]
    lib.tierd_adam_state_bytes.restype = u64
    lib.tierd_adam_set_params.argtypes = [p, ctypes.c_size_t, fp, u64]
    lib.tierd_adam_get_params.argtypes = [p, ctypes.c_size_t, fp, u64]
    lib.tierd_adam_get_state.argtypes = [p, ctypes.c_size_t, ctypes.c_int, fp, u64]
    lib.tierd_adam_set_state.argtypes = [p, ctypes.c_size_t, fp, fp, fp, u64]
    lib.tierd_adam_set_steps.argtypes = [p, ctypes.c_int64]
    lib.tierd_adam_set_lr.argtypes = [p, ctypes.c_double]
    lib.tierd_adam_set_group_hyper.argtypes = [p, ctypes.c_size_t, ctypes.POINTER(AdamHyper)]
    lib.tierd_adam_begin_step.argtypes = [p, ctypes.c_float]
    lib.tierd_adam_step_group.argtypes = [p, ctypes.c_size_t, p, ctypes.c_int, p, ctypes.c_int]
    lib.tierd_adam_finish_step.argtypes = [p, ctypes.POINTER(AdamStepStats)]
    lib.tierd_adam_abandon_step.argtypes = [p]
    lib.tierd_adam_wait_group.argtypes = [p, ctypes.c_size_t, ctypes.c_int64]
    lib.tierd_adam_set_group_place.argtypes = [p, ctypes.c_size_t, ctypes.c_int]
    lib.tierd_adam_group_place.argtypes = [p, ctypes.c_size_t]
    lib.tierd_adam_lanes_get.argtypes = [p, ctypes.POINTER(AdamLanes)]


_lib = None


def library():
    """The client library, loaded (and its signatures bound) at the first call."""
    global _lib
    if _lib is None:
        _lib = load_library()
    return _lib


def check(status: int) -> None:
    """Raises TierdError with the library's last error unless `status` is OK."""
    if status != OK:
        raise TierdError(status, library().tierd_last_error().decode(errors="replace"))
