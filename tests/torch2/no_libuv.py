"""Debian 13's python3-torch (2.6) is built without libuv, yet every c10d store it makes asks for
libuv unless told otherwise, and the stores that torchrun's workers make cannot be told: each one
ends in "use_libuv was requested but PyTorch was build without libuv support". In the chroot of
tests/torch2/run.sh only (a .pth file there imports this), torch.distributed's TCPStore asks for
libuv only when a caller does.

The patch is made when torch.distributed is first imported, so that other processes do not pay
for importing torch."""
import importlib.abc
import importlib.util
import sys

_USERS = ("torch.distributed.rendezvous", "torch.distributed.distributed_c10d")


def _patch(dist) -> None:
    base = dist.TCPStore

    class TCPStore(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("use_libuv", False)
            super().__init__(*args, **kwargs)

    dist.TCPStore = TCPStore
    for name in _USERS:  # imported the name while torch.distributed itself was imported
        module = sys.modules.get(name)
        if module is not None and getattr(module, "TCPStore", None) is base:
            module.TCPStore = TCPStore


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
