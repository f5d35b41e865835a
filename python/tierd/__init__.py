"""tierd from Python: sessions with the node's tier daemon, chunks in GPU, host and NVMe memory.

Pure Python over the client library's C ABI (libtierd_client.so.0, found beside this package, in
a source checkout's build/, or installed), so it needs no compiler and works with any Python >= 3.9
and any torch. `python3 -m tierd status` is a quick check. `tierd.torch` (imported on its own, so
that `import tierd` needs no torch) has OffloadedAdamW, an AdamW whose state lives in tierd.
`tierd.__version__` is the release (the .deb and the wheel carry the same). Every error tierd
raises is a TierdError with a gRPC status code (_errors.py has the family), and what it says as
it works goes to the `tierd` logger (quiet unless the application configures logging).
"""
import logging

from ._errors import (FailedPrecondition, InvalidArgument, InvalidType, MissingDependency,
                      NotFound, PermissionDenied, Status, TierdError, UnsafePickle, ViewConsumed)
from ._version import __version__
from .client import (Access, Acquisition, ChunkSet, Client, Completion, DLPackView, SessionStats,
                     Tier, TierUsage, connect)

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["__version__", "Access", "Acquisition", "ChunkSet", "Client", "Completion", "DLPackView",
           "FailedPrecondition", "InvalidArgument", "InvalidType", "MissingDependency", "NotFound",
           "PermissionDenied", "SessionStats", "Status", "Tier", "TierdError", "TierUsage",
           "UnsafePickle", "ViewConsumed", "connect"]
