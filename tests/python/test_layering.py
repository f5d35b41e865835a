"""tierd.torch's rooms import only downward: the architecture as a check that fails.

LEVELS lists the package's modules from the bottom up; a module may import (at its top or inside
a function) only modules on lower levels, and the package's parents (tierd._abi, tierd.client,
tierd._adam). A module the list does not place fails too: a new room says where it stands.
The check itself is checked: an upward import planted in a copy of the package is reported.
"""
import ast
import os
import shutil

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "tierd",
                       "torch")

# From the bottom up; modules on one level do not import each other.
LEVELS = [
    ["_storage", "_pretrained", "_agree", "_hf_keys", "_base_check"],  # tensors over tierd
                                            # memory; checkpoints in the HF layout; every rank's
                                            # outcome; keys as transformers names them; a
                                            # shared base's check in the background
    ["_units", "activations", "_materialize", "_guard"],  # units and chunks; activation
                                                # offload; where a stream's weights come from;
                                                # a streamed parameter outside the window
    ["_trace", "_base"],         # the recorded order, the daemon's schedule; a shared base
    ["_window", "_ranks"],       # the device window; the ranks' one set of weights
    ["_stream_hooks", "_loading"],  # the hooks and the training state; load_state_dict
    ["streaming"],               # ParameterStream, and StreamRange: the seam to the optimizer
    ["_buckets", "_shard", "_checkpoint", "testing"],
    ["_lanes"],                  # which buckets the device steps
    ["_state"],                  # the optimizer's state record
    ["_layout", "_verdict", "_release"],  # the groups as buckets; clip, skip, speculation;
                                          # what a step holds, given back early
    ["_intake"],                 # gradients in during backward
    ["optimizer"],               # OffloadedAdamW: the step's coordinator
    ["__init__", "hf"],          # the public face; transformers' Trainer for it
]


def upward_imports(package: str):
    """(importer, imported) pairs that break LEVELS, and modules LEVELS does not place."""
    level = {m: k for k, names in enumerate(LEVELS) for m in names}
    problems = []
    for file in sorted(os.listdir(package)):
        if not file.endswith(".py"):
            continue
        module = file[:-3]
        if module not in level:
            problems.append((module, "is not placed in LEVELS"))
            continue
        with open(os.path.join(package, file)) as f:
            tree = ast.parse(f.read(), file)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level != 1:
                continue  # absolute, or the parent package's (tierd.client, tierd._abi)
            targets = [node.module] if node.module else [a.name for a in node.names]
            for target in targets:
                target = target.split(".")[0]
                if target not in level:
                    problems.append((module, f"imports {target}, which LEVELS does not place"))
                elif level[target] >= level[module]:
                    problems.append((module, f"imports {target} (level {level[target]}) from "
                                             f"level {level[module]}"))
    return problems


def test_rooms_import_only_downward():
    assert upward_imports(PACKAGE) == []


def test_every_level_is_a_module():
    present = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")}
    assert {m for names in LEVELS for m in names} == present


@pytest.mark.parametrize("module,planted", [
    ("_units", "from .streaming import ParameterStream\n"),       # the stream's leaf calls up
    ("_buckets", "from . import optimizer\n"),                    # a bucket reaches its owner
    ("_window", "def f():\n    from ._stream_hooks import StreamHooks\n"),  # inside a function
    ("_layout", "from ._verdict import Verdict\n"),               # sideways, on one level
])
def test_a_planted_upward_import_fails(tmp_path, module, planted):
    copy = tmp_path / "torch"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / f"{module}.py"
    path.write_text(path.read_text() + "\n" + planted)
    problems = upward_imports(str(copy))
    assert [p[0] for p in problems] == [module]


def test_an_unplaced_module_fails(tmp_path):
    copy = tmp_path / "torch"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "_new_room.py").write_text("from ._storage import resize\n")
    assert upward_imports(str(copy)) == [("_new_room", "is not placed in LEVELS")]
