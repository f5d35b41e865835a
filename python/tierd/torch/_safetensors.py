"""Checkpoints in the Hugging Face layout: a `.safetensors` file, or a directory with
`model.safetensors` or shards named by `model.safetensors.index.json`. Read one tensor at a time
(every key's shape and dtype known, and checked, before a byte of data is read); written one
shard at a time. Knows nothing of streams: streaming.py and _sources.py use it.

Each header is checked by the `safetensors` library (offsets in order, inside the file, none
overlapping); what it does not check, this does: an index's shards are files beside it, every
key the index names is in its shard and no shard holds a key twice. The data is then read with
pread straight into where it goes (a chunk's memory, when the dtype is the model's): no mapping
of the file, so the process's memory holds no more of it than the tensor being converted.
"""
import copy
import hashlib
import json
import os
import re
import stat
import struct
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .._errors import InvalidArgument, MissingDependency, NotFound

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _regular(path: str, what: str) -> bool:
    """Whether `path` exists: False when it does not, True when it is a regular file (or a link
    to one); anything else (a FIFO would block the reader forever, a device or a socket, a
    directory named like a file) is refused at once, naming it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as e:
        raise InvalidArgument(f"{path}: {what} cannot be read ({e})") from None
    if not stat.S_ISREG(mode):
        raise InvalidArgument(f"{path}: {what} is {_kind(mode)}, not a regular file")
    return True


def _open_regular(path: str) -> int:
    """A descriptor of `path`, opened without blocking (a FIFO swapped in since it was checked
    is refused, not waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InvalidArgument(f"{path}: a checkpoint file is {_kind(mode)}, not a regular file")
    return fd


def _safetensors():
    try:
        import safetensors
        import safetensors.torch  # noqa: F401 (safe_open's torch framework)
    except ImportError as e:  # pragma: no cover (requirements.txt has it)
        raise MissingDependency("checkpoints in the Hugging Face layout need the safetensors "
                                "package (pip install safetensors)") from e
    return safetensors


class Entry:
    """One tensor of a checkpoint: where it is (its file, and its bytes there), shape, dtype."""

    def __init__(self, file: str, shape: Tuple[int, ...], dtype: torch.dtype, start: int,
                 end: int):
        self.file, self.shape, self.dtype = file, shape, dtype
        self.start, self.end = start, end


class FileSpan:
    """A tensor's bytes in a checkpoint file, as stored: what the daemon reads straight into a
    chunk (Client.import_file), with the file as it was when its layout was read. Called with a
    flat tensor of the stored dtype, reads them into it in this process instead."""

    __slots__ = ("fd", "start", "nbytes", "size", "mtime_ns", "_read")

    def __init__(self, fd: int, start: int, nbytes: int, seen: Tuple[int, int],
                 read: Callable[[torch.Tensor], None]):
        self.fd, self.start, self.nbytes = fd, start, nbytes
        self.size, self.mtime_ns = seen
        self._read = read

    def __call__(self, out: torch.Tensor) -> None:
        self._read(out)


class Checkpoint:
    """The tensors of a checkpoint by key, opened and checked at construction; tensors are read
    one at a time by read()."""

    def __init__(self, path: str):
        path = os.fspath(path)
        self.path = path
        if os.path.isdir(path):
            index = os.path.join(path, INDEX)
            single = os.path.join(path, SINGLE)
            if _regular(index, "the checkpoint's index"):
                files = self._from_index(index)
            elif _regular(single, "the checkpoint's file"):
                files = {single: None}
            else:
                raise NotFound(f"{path}: no {SINGLE} and no {INDEX} in the directory")
        elif _regular(path, "the checkpoint"):
            files = {path: None}
        else:
            raise NotFound(f"{path}: no such file or directory")
        self.entries: Dict[str, Entry] = {}
        self._open: Dict[str, int] = {}  # file -> descriptor
        self._seen: Dict[str, Tuple[int, int]] = {}  # file -> (size, mtime_ns) when scanned
        try:
            for file, wanted in files.items():
                self._scan(file, wanted)
        except BaseException:
            self.close()
            raise

    def _from_index(self, index: str) -> Dict[str, List[str]]:
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"{index}: not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict):
            raise InvalidArgument(f"{index}: weight_map is not a mapping of keys to shards")
        directory = os.path.dirname(index)
        files: Dict[str, List[str]] = {}
        for key, shard in weight_map.items():
            if not isinstance(shard, str) or os.path.basename(shard) != shard or \
                    shard in ("", ".", ".."):
                raise InvalidArgument(f"{index}: key {key!r} names the shard {shard!r}, which is "
                                      "not a file in the index's directory")
            file = os.path.join(directory, shard)
            if not _regular(file, f"the shard of key {key!r}"):
                raise NotFound(f"{index}: key {key!r} is in the shard {shard!r}, which "
                               "is missing")
            files.setdefault(file, []).append(key)
        return files

    def _scan(self, file: str, wanted: Optional[List[str]]) -> None:
        st = _safetensors()
        try:
            fd = self._fd(file)  # a regular file, checked on its descriptor
            seen = os.fstat(fd)
            self._seen[file] = (seen.st_size, seen.st_mtime_ns)
            # safe_open reads the very file that was checked, not what the path names now.
            with st.safe_open(f"/proc/self/fd/{fd}", framework="pt", device="cpu") as f:
                keys = list(f.keys())  # the header checked against the file
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, n, 8))
        except st.SafetensorError as e:
            raise InvalidArgument(f"{file}: not a readable safetensors file ({e})") from None
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"{file}: cannot be read ({e})") from None
        for key in keys:
            info = header[key]
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise InvalidArgument(f"{file}: key {key!r} is of dtype {info['dtype']}, which "
                                      "tierd does not read")
            if key in self.entries:
                raise InvalidArgument(f"{file}: key {key!r} is also in {self.entries[key].file}")
            start, end = info["data_offsets"]
            self.entries[key] = Entry(file, tuple(info["shape"]), dtype, 8 + n + start,
                                      8 + n + end)
        if wanted is not None:
            missing = sorted(set(wanted) - set(keys))
            if missing:
                raise InvalidArgument(f"{file}: the index puts {missing[0]!r} in this shard, which "
                                      f"does not hold it ({len(missing)} such keys)")

    SAMPLE = 4096  # bytes of each end of every tensor that digest() reads

    def digest(self) -> str:
        """What identifies the checkpoint without reading all of it: a SHA-256 of each key's
        shape, dtype, file name and byte range, and of the first and last SAMPLE bytes of its
        data (a fine-tune of the same model differs there, as a rule)."""
        h = hashlib.sha256()
        for key in sorted(self.entries):
            e = self.entries[key]
            h.update(json.dumps([key, list(e.shape), str(e.dtype), os.path.basename(e.file),
                                 e.start, e.end]).encode())
            fd = self._fd(e.file)
            n = min(self.SAMPLE, e.end - e.start)
            h.update(os.pread(fd, n, e.start))
            h.update(os.pread(fd, n, e.end - n))
        return h.hexdigest()

    def _fd(self, file: str) -> int:
        fd = self._open.get(file)
        if fd is None:
            fd = self._open[file] = _open_regular(file)
        return fd

    def read(self, key: str) -> torch.Tensor:
        """The tensor under `key`, as stored (a CPU tensor of its own)."""
        e = self.entries[key]
        out = torch.empty(e.shape, dtype=e.dtype)
        self._pread(e, key, out)
        return out

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """The tensor under `key` into `out` (contiguous, CPU, of its numel), converted to out's
        dtype: read straight into it when the dtypes are the same."""
        e = self.entries[key]
        if out.dtype == e.dtype:
            self._pread(e, key, out)
        else:
            out.copy_(self.read(key).reshape(-1))

    def span(self, key: str) -> FileSpan:
        """Where the tensor under `key` lies in its file, for the daemon to read as stored."""
        e = self.entries[key]
        return FileSpan(self._fd(e.file), e.start, e.end - e.start, self._seen[e.file],
                        lambda out: self.read_into(key, out))

    def _pread(self, e: Entry, key: str, out: torch.Tensor) -> None:
        fd = self._fd(e.file)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        if len(view) != e.end - e.start:
            raise InvalidArgument(f"{e.file}: key {key!r} holds {e.end - e.start} bytes, not "
                                  f"{len(view)}")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], e.start + done)
            if n <= 0:  # the file is shorter than its header says: it changed under us
                raise InvalidArgument(f"{e.file}: key {key!r} ends past the end of the file")
            done += n

    def duplicate(self) -> "Checkpoint":
        """The same checkpoint over descriptors of its own (the files checked at construction),
        for another thread to read while this one is closed."""
        twin = copy.copy(self)
        twin._open = {}
        try:
            for file, fd in self._open.items():
                twin._open[file] = os.dup(fd)
        except BaseException:
            twin.close()
            raise
        return twin

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open = {}


def convertible(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether a stored dtype may be converted to the model's: floating point to floating point;
    anything else only as it is."""
    return stored == wanted or (stored.is_floating_point and wanted.is_floating_point)


def parse_size(size) -> int:
    """A shard size: bytes, or a string such as "5GB", "500MB", "2GiB" (as transformers takes)."""
    if isinstance(size, int):
        if size <= 0:
            raise InvalidArgument(f"max_shard_size must be > 0, not {size}")
        return size
    text = str(size).strip().upper()
    units = [("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9),
             ("MB", 10**6), ("KB", 10**3), ("B", 1)]
    for suffix, scale in units:
        if text.endswith(suffix):
            try:
                value = float(text[:-len(suffix)]) * scale
            except ValueError:
                break
            if value > 0:
                return int(value)
            break
    raise InvalidArgument(f"max_shard_size: {size!r} is not a size such as 5GB or 500MB")


def write(directory: str, tensors: List[Tuple[str, Tuple[int, ...], torch.dtype]],
          read: Callable[[str], torch.Tensor], max_shard_size: int,
          metadata: Optional[Dict[str, str]] = None,
          done: Callable[[int], None] = lambda n: None) -> List[str]:
    """Writes the tensors (name, shape, dtype), in that order, as safetensors shards of at most
    max_shard_size bytes (a tensor larger than that gets a shard of its own) in the Hugging Face
    layout: one `model.safetensors`, or `model-0000k-of-0000n.safetensors` and the index. Each
    shard's tensors are asked of read(name) as it is written: at most one shard is in memory;
    done(bytes) follows each tensor read. Returns the files written. Files are written under
    temporary names and renamed when whole; the index (or the single file) last."""
    st = _safetensors()
    os.makedirs(directory, exist_ok=True)
    shards: List[List[str]] = [[]]
    sizes = [0]
    total = 0
    for name, shape, dtype in tensors:
        n = torch.Size(shape).numel() * dtype.itemsize
        total += n
        if shards[-1] and sizes[-1] + n > max_shard_size:
            shards.append([])
            sizes.append(0)
        shards[-1].append(name)
        sizes[-1] += n
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        names = [SINGLE]
    else:
        names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                 for k in range(len(shards))]
    written = []
    for shard, file in zip(shards, names):
        data = {}
        for name in shard:
            data[name] = read(name).contiguous()
            done(data[name].numel() * data[name].element_size())
        final = os.path.join(directory, file)
        st.torch.save_file(data, final + ".tmp", metadata=meta)
        os.replace(final + ".tmp", final)
        written.append(final)
        del data
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for shard, file in zip(shards, names)
                                for name in shard}}
        final = os.path.join(directory, INDEX)
        with open(final + ".tmp", "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(final + ".tmp", final)
        written.append(final)
    # What an earlier save left that this one does not name: a single file or other shards.
    for file in os.listdir(directory):
        stale = os.path.join(directory, file)
        if stale not in written and (file in (SINGLE, INDEX) or _SHARD.fullmatch(file)):
            os.remove(stale)
    return written

