"""OffloadedAdamW checkpoints that move between nodes and world sizes.

An optimizer sharded over ranks (ZeRO-1) keeps each rank's share of the state in that rank's
node's daemon. A checkpoint holds every rank's share; loading it in a job of any number of ranks
on any nodes gives each rank the state of the parameters it owns under the new sharding (the
state resharded on load). Two formats, chosen at save and recognised at load:

`dcp`, where torch has torch.distributed.checkpoint's save and load (2.2 and newer): a DCP
checkpoint, written and read collectively by the ranks, so that DCP's own tools read it too. Its
keys are flat and each parameter's entries are written by the rank that owns it only:

    optimizer.meta                   uint8 tensor: JSON {"format", "world", "state_name"}
    optimizer.param_groups           uint8 tensor: the groups as JSON
    optimizer.state.<index>.<key>    step, exp_avg, exp_avg_sq, master (state_dict() entries)

A rank loads the entries of the parameters it now owns and every parameter's step (so that every
rank agrees on the steps taken), reading from the metadata what there is to read.

`torch`, everywhere: one torch.save file per rank, written whole or not at all (a temporary file,
synced, then renamed); each loading rank reads every file and keeps its new share, holding at most
that plus one old file at a time.

    directory/optimizer.rank<r>of<n>.pt   {"format", "rank", "world", "node", "state_name",
                                           "param_groups" (JSON), "state"}

A checkpoint is data, never code. Tensors are read with torch.load(weights_only=True); the groups
are JSON (torch 1.13's safe loader takes no floats), so nothing else is unpickled. DCP keeps its
metadata as a pickle, which DCP's reader would unpickle whatever it asks for: it is checked first
by an unpickler that makes nothing but DCP's metadata records, and every entry read must be a
tensor (DCP unpickles any other kind without restriction).
"""
import contextlib
import dataclasses
import enum
import glob
import io
import json
import os
import pickle
import re
import socket
import warnings
from typing import Any, Dict, Optional, Set, Tuple

import torch

from .._errors import InvalidArgument, NotFound, UnsafePickle

FORMAT = 1
_NAME = re.compile(r"optimizer\.rank(\d+)of(\d+)\.pt$")
_PREFIX = "optimizer."
_ENTRY = re.compile(r"optimizer\.state\.(\d+)\.(step|exp_avg|exp_avg_sq|master)$")
_DCP_METADATA = ".metadata"
_MAX_JSON = 64 << 20  # the longest meta or groups text a checkpoint may declare


def _dcp():
    """torch.distributed.checkpoint where it has save and load (torch 2.2 and newer), else
    None."""
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return None
    if not all(hasattr(dcp, n) for n in ("save", "load", "FileSystemWriter",
                                           "FileSystemReader")):
        return None
    return dcp


def formats() -> Set[str]:
    """The formats this torch can write and read."""
    return {"torch", "dcp"} if _dcp() is not None else {"torch"}


def shard_path(directory: str, rank: int, world: int) -> str:
    return os.path.join(directory, f"optimizer.rank{rank}of{world}.pt")


def save(directory: str, rank: int, world: int, state_name: str, state_dict: Dict[str, Any],
         format: Optional[str] = None, group=None) -> None:
    """Writes this rank's share in `format` (None: dcp where this torch has it, else torch).
    Every rank calls it; with dcp it is collective over `group`, the ranks' process group (None
    for one rank)."""
    format = format or ("dcp" if _dcp() is not None else "torch")
    if format not in ("dcp", "torch"):
        raise InvalidArgument(f"checkpoint format {format!r}: 'dcp' or 'torch'")
    if format not in formats():
        raise InvalidArgument("checkpoint format 'dcp' needs torch.distributed.checkpoint's save "
                              f"and load (torch 2.2 or newer); this is torch {torch.__version__}: "
                              "use format='torch'")
    os.makedirs(directory, exist_ok=True)
    if format == "torch":
        _save_files(directory, rank, world, state_name, state_dict)
    else:
        _save_dcp(directory, world, state_name, state_dict, group)


def load(directory: str, owned: Dict[int, Tuple[int, ...]], group=None) -> Dict[str, Any]:
    """The state_dict to load on a rank that owns the parameters `owned` (state_dict index ->
    shape): their entries, and of every other parameter only its step count. Every rank calls
    it; a dcp checkpoint is read collectively over `group`."""
    is_dcp = os.path.exists(os.path.join(directory, _DCP_METADATA))
    files = _shard_files(directory)
    if is_dcp and files:
        raise InvalidArgument(f"{directory} holds a checkpoint in both formats (a DCP .metadata "
                              "and optimizer.rank<r>of<n>.pt files): keep the files of one save "
                              "only")
    if is_dcp:
        if _dcp() is None:
            raise InvalidArgument(f"{directory} is a torch.distributed.checkpoint (DCP) "
                                  f"checkpoint, which torch {torch.__version__} cannot read: load "
                                  "it with torch 2.2 or newer, or save with format='torch'")
        return _load_dcp(directory, owned, group)
    if not files:
        raise NotFound(
            f"no optimizer checkpoint in {directory}: save_checkpoint writes a DCP checkpoint "
            "(.metadata and its .distcp files) or optimizer.rank<r>of<n>.pt, one file per rank")
    return _load_files(directory, files, owned)


# ---- one torch.save file per rank ----

def _save_files(directory: str, rank: int, world: int, state_name: str,
                state_dict: Dict[str, Any]) -> None:
    path = shard_path(directory, rank, world)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, "rank": rank, "world": world, "node": socket.gethostname(),
                    "state_name": state_name,
                    "param_groups": json.dumps(state_dict["param_groups"]),
                    "state": state_dict["state"]}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename too
    finally:
        os.close(fd)


def _shard_files(directory: str) -> Dict[tuple, str]:
    files = {}
    for path in glob.glob(os.path.join(directory, "optimizer.rank*of*.pt")):
        m = _NAME.search(os.path.basename(path))
        if m:
            files[(int(m.group(1)), int(m.group(2)))] = path
    return files


def _load_files(directory: str, files: Dict[tuple, str],
                owned: Dict[int, Tuple[int, ...]]) -> Dict[str, Any]:
    worlds = sorted({w for _, w in files})
    if len(worlds) > 1:
        raise InvalidArgument(f"{directory} holds the shards of jobs of {worlds} ranks: keep the "
                              "files of one save only")
    world = worlds[0]
    missing = sorted(set(range(world)) - {r for r, _ in files})
    if missing:
        raise NotFound(
            f"{directory} is a checkpoint of {world} ranks, but the files of rank(s) "
            f"{', '.join(map(str, missing))} are not there: copy every rank's file "
            f"(optimizer.rank<r>of{world}.pt) from the nodes that saved them")
    state: Dict[int, Dict[str, Any]] = {}
    groups = None
    seen: Set[int] = set()
    for rank in range(world):
        data = torch.load(files[(rank, world)], map_location="cpu", weights_only=True)
        if data.get("format") != FORMAT or data.get("rank") != rank or data.get("world") != world:
            raise InvalidArgument(f"{files[(rank, world)]} is not rank {rank} of {world}'s shard "
                                  f"of an optimizer checkpoint (format {FORMAT})")
        saved_groups = json.loads(data["param_groups"])
        if groups is None:
            groups = saved_groups
        elif groups != saved_groups:
            raise InvalidArgument(f"the shards in {directory} disagree on the parameter groups: "
                                  "they are not from one save of one job")
        for index, entry in data["state"].items():
            if index in seen:
                raise InvalidArgument(f"parameter {index}'s state is in two shards in {directory}")
            seen.add(index)
            if index in owned:
                state[index] = entry
            elif "step" in entry:
                state[index] = {"step": entry["step"]}
        del data
    return {"state": state, "param_groups": groups}


# ---- torch.distributed.checkpoint ----

def _json_tensor(value: Any) -> torch.Tensor:
    return torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)


def _from_json_tensor(directory: str, key: str, t: torch.Tensor) -> Any:
    try:
        return json.loads(bytes(t.tolist()).decode())
    except ValueError as e:
        raise InvalidArgument(f"{directory}: entry {key} is not a JSON text ({e})") from None


def _save_dcp(directory: str, world: int, state_name: str, state_dict: Dict[str, Any],
              group) -> None:
    dcp = _dcp()
    flat = {_PREFIX + "meta": _json_tensor({"format": FORMAT, "world": world,
                                            "state_name": state_name}),
            _PREFIX + "param_groups": _json_tensor(state_dict["param_groups"])}
    for index, entry in state_dict["state"].items():
        for key, value in entry.items():
            flat[f"{_PREFIX}state.{index}.{key}"] = value
    with _one_process_meant():
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(directory), process_group=group)


@contextlib.contextmanager
def _one_process_meant():
    """DCP warns that it assumes one process where torch.distributed is not initialised: so it
    is, with an optimizer that is not sharded."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is unavailable or "
                                "uninitialized")
        yield


def _load_dcp(directory: str, owned: Dict[int, Tuple[int, ...]], group) -> Dict[str, Any]:
    dcp = _dcp()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = _checked_reader(dcp.FileSystemReader, directory)
    entries = reader.read_metadata().state_dict_metadata
    if _PREFIX + "meta" not in entries or _PREFIX + "param_groups" not in entries:
        raise InvalidArgument(f"{directory} is a DCP checkpoint, but not of an OffloadedAdamW "
                              "(no optimizer.meta or optimizer.param_groups in it)")
    # What a rank reads, each entry checked against what it can be before its room is made.
    wanted = {_PREFIX + "meta": None, _PREFIX + "param_groups": None}
    for key in entries:
        m = _ENTRY.match(key)
        if m and m.group(2) == "step":
            wanted[key] = ()
        elif m and int(m.group(1)) in owned:
            wanted[key] = tuple(owned[int(m.group(1))])
    template = {}
    for key, shape in sorted(wanted.items()):
        md = entries[key]
        # Anything but a tensor, DCP would unpickle without restriction.
        if not isinstance(md, TensorStorageMetadata):
            raise InvalidArgument(f"{directory}: entry {key} is not a tensor in the checkpoint")
        size = tuple(md.size)
        if shape is None and (len(size) != 1 or size[0] > _MAX_JSON
                              or md.properties.dtype != torch.uint8):
            raise InvalidArgument(f"{directory}: entry {key} of shape {size} is not a JSON text")
        if shape == () and size not in ((), (1,)):
            raise InvalidArgument(f"{directory}: entry {key} of shape {size} is not a step count")
        if shape and size != shape:
            raise InvalidArgument(f"{directory}: entry {key} of shape {size} for a parameter of "
                                  f"shape {shape}")
        if shape is not None and not (md.properties.dtype.is_floating_point or shape == ()):
            raise InvalidArgument(f"{directory}: entry {key} is of {md.properties.dtype}, not a "
                                  "floating point type")
        template[key] = torch.empty(size, dtype=md.properties.dtype)
    with _one_process_meant():
        dcp.load(template, storage_reader=reader, process_group=group)
    meta = _from_json_tensor(directory, _PREFIX + "meta", template.pop(_PREFIX + "meta"))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InvalidArgument(f"{directory} is a DCP checkpoint of an OffloadedAdamW of another "
                              f"format ({meta!r}, this one reads {FORMAT})")
    groups = _from_json_tensor(directory, _PREFIX + "param_groups",
                               template.pop(_PREFIX + "param_groups"))
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise InvalidArgument(f"{directory}: entry {_PREFIX}param_groups is not a list of groups")
    state: Dict[int, Dict[str, Any]] = {}
    for key, value in template.items():
        m = _ENTRY.match(key)
        state.setdefault(int(m.group(1)), {})[m.group(2)] = value
    return {"state": state, "param_groups": groups}


_PATHS = {"Path", "PosixPath", "PurePath", "PurePosixPath"}


class _MetadataUnpickler(pickle.Unpickler):
    """Makes DCP's metadata records (the dataclasses and enums of torch.distributed.checkpoint's
    modules), torch's sizes, dtypes and layouts, paths and plain containers; refuses anything
    else a pickle names (a function to call, say)."""

    def find_class(self, module, name):
        if module.startswith("torch.distributed.checkpoint."):
            value = super().find_class(module, name)
            if isinstance(value, type) and (dataclasses.is_dataclass(value)
                                            or issubclass(value, enum.Enum)):
                return value
        elif module == "torch" and name == "Size":
            return torch.Size
        elif module == "torch.serialization" and name == "_get_layout":  # a layout by its name
            return super().find_class(module, name)
        elif module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        elif (module, name) in (("collections", "OrderedDict"), ("builtins", "set"),
                                ("builtins", "frozenset"), ("builtins", "slice")):
            return super().find_class(module, name)
        elif module in ("pathlib", "pathlib._local") and name in _PATHS:  # where it was saved
            return super().find_class(module, name)
        elif (module, name) == ("builtins", "getattr"):  # how Python 3.11+ pickles an enum member
            return _enum_member
        raise UnsafePickle(f"a checkpoint's metadata may not name {module}.{name}")


def _enum_member(cls, name):
    """getattr as an enum member's pickle uses it, and for nothing else."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str)
            and name in cls.__members__):
        raise UnsafePickle(f"a checkpoint's metadata may not take {name!r} of {cls!r}")
    return cls.__members__[name]


def _checked_reader(base, directory: str):
    """DCP's file system reader, whose metadata is checked by _MetadataUnpickler before DCP
    reads it."""

    class CheckedReader(base):
        def read_metadata(self):
            with open(os.path.join(directory, _DCP_METADATA), "rb") as f:
                _MetadataUnpickler(io.BytesIO(f.read())).load()
            return super().read_metadata()

    return CheckedReader(directory)
