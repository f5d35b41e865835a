"""tierd from Python: sessions with the node's tier daemon, chunks in GPU, host and NVMe memory.

Pure Python over the client library's C ABI (libtierd_client.so.0, found beside this package, in
a source checkout's build/, or installed), so it needs no compiler and works with any Python >= 3.9
and any torch. `python3 -m tierd status` is a quick check. `tierd.torch` (imported on its own, so
that `import tierd` needs no torch) has OffloadedAdamW, an AdamW whose state lives in tierd.
`tierd.__version__` is the release (the .deb and the wheel carry the same).
"""
from ._version import __version__
from .client import (Access, Acquisition, ChunkSet, Client, Completion, DLPackView, SessionStats,
                     Tier, TierdError, TierUsage, connect)

__all__ = ["__version__", "Access", "Acquisition", "ChunkSet", "Client", "Completion", "DLPackView",
           "SessionStats", "Tier", "TierdError", "TierUsage", "connect"]
