"""python3 -m tierd.torchrun ARGS: torch's `torchrun ARGS`, runnable where torchrun itself fails.

torch 1.13's launcher parses its --redirects and --tee values by iterating an IntFlag, which on
Python 3.11 no longer yields the zero member: every invocation, the default "0" included, ends
in "AttributeError: 'NoneType' object has no attribute 'get'" (Debian 12's python3-torch is such
a build). Where that is so, this parses those two values directly and then runs torchrun
unchanged; elsewhere it is torchrun as it is.

    PYTHONPATH=python python3 -m tierd.torchrun --standalone --nproc_per_node=2 \\
        examples/train_gpt.py --socket-dir var/run
"""
import re
import sys


def _repair_std_parsing() -> None:
    from torch.distributed.elastic.multiprocessing import api

    std = api.Std
    if std.from_str("0") is not None:
        return  # this torch parses them correctly
    broken = std.from_str.__func__

    def from_str(cls, vm: str):
        if re.match(api._VALUE_REGEX, vm):
            return cls(int(vm))
        if re.match(api._MAPPING_REGEX, vm):
            return {int(i): cls(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
        return broken(cls, vm)  # raises its own error for a malformed value

    std.from_str = classmethod(from_str)


def main() -> int:
    _repair_std_parsing()
    from torch.distributed import run

    sys.argv[0] = "torchrun"
    return run.main() or 0


if __name__ == "__main__":
    sys.exit(main())
