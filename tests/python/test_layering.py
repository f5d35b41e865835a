"""tierd.torch's rooms import only downward, in two towers that never import each other: the
architecture as a check that fails.

The package stands as FSDP2 and torch.optim do: the stream (its hooks, window and trace) and the
optimizer (its buckets, state and step) are two towers on the floors below them, and they meet
at one seam room, _ranges, the top floor under both. FLOORS lists the shared floors from the
bottom up, TOWERS each tower's floors from the bottom up, FACE the floors over both. A
module may import (at its top or inside a function) only modules on lower floors and not of the
other tower, and the package's parents (tierd._abi, tierd.client, tierd._adam). A module the lists
do not place fails too: a new room says where it stands. The check itself is checked: upward,
sideways and cross-tower imports planted in a copy of the package are reported.
"""
import ast
import os
import shutil

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "tierd",
                       "torch")

# From the bottom up; modules on one floor do not import each other.
FLOORS = [
    ["_storage", "_safetensors", "_agree", "_hf_keys", "_base_check", "_held_base",
     "_figures", "_progress"],
                                            # tensors over tierd memory; checkpoints in the HF
                                            # layout; every rank's outcome; keys as transformers
                                            # names them; a shared base's check in the
                                            # background; a base held in the daemon; a
                                            # stream's counters; progress bars
    ["_grad_chunks"],            # the optimizer's gradients of a unit's ranges, in chunks
    ["_units", "activations", "_sources", "_guard"],  # units and chunks; activation
                                                # offload; where a stream's weights come from;
                                                # a streamed parameter outside the window
    ["_ranges"],                 # the seam: a stream's parts lent to the optimizer's ranges
]
TOWERS = {
    "stream": [
        ["_trace", "_shared_base"],  # the recorded order, the daemon's schedule; a shared base
        ["_window", "_ranks"],       # the device window; the ranks' one set of weights
        ["_stream_hooks", "_loading", "_ddp", "_seam"],  # the hooks and the training
                                                # state; load_state_dict; DDP leaving it
                                                # alone; the optimizer's calls up
        ["_gather"],                 # gathered() and save_pretrained()
        ["streaming"],               # ParameterStream, stream_parameters
    ],
    "optimizer": [
        ["_buffers"],                # a bucket's buffers: this process's, or a range's chunks
        ["_buckets", "_shard", "_state_files"],  # buckets and their steps' records; the
                                                # collectives over ranks; the state's files
        ["_lanes"],                  # which buckets the device steps
        ["_state"],                  # the optimizer's state record
        ["_layout", "_verdict", "_release"],  # the groups as buckets; clip, skip, speculation;
                                              # what a step holds, given back early
        ["_intake"],                 # gradients in during backward
        ["_stepping"],               # a step, from its first gradient to the new weights
        ["optimizer"],               # OffloadedAdamW: the optimizer's face
    ],
}
FACE = [
    ["_step_figures"],           # each step's figures, of the stream and the optimizer together
    ["__init__", "hf", "testing"],  # the public face; transformers' Trainer; test hooks
]


def placement():
    """Each module's (floor number, tower or None)."""
    where = {m: (k, None) for k, names in enumerate(FLOORS) for m in names}
    for tower, floors in TOWERS.items():
        where.update({m: (len(FLOORS) + k, tower) for k, names in enumerate(floors)
                      for m in names})
    top = len(FLOORS) + max(len(floors) for floors in TOWERS.values())
    where.update({m: (top + k, None) for k, names in enumerate(FACE) for m in names})
    return where


def upward_imports(package: str):
    """(importer, problem) pairs that break the floors or the towers, and modules not placed."""
    where = placement()
    problems = []
    for file in sorted(os.listdir(package)):
        if not file.endswith(".py"):
            continue
        module = file[:-3]
        if module not in where:
            problems.append((module, "is not placed in FLOORS, TOWERS or FACE"))
            continue
        with open(os.path.join(package, file)) as f:
            tree = ast.parse(f.read(), file)
        floor, tower = where[module]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level != 1:
                continue  # absolute, or the parent package's (tierd.client, tierd._abi)
            targets = [node.module] if node.module else [a.name for a in node.names]
            for target in targets:
                target = target.split(".")[0]
                if target not in where:
                    problems.append((module, f"imports {target}, which is not placed"))
                    continue
                their_floor, their_tower = where[target]
                if tower is not None and their_tower not in (None, tower):
                    problems.append((module, f"of the {tower} tower imports {target} of the "
                                             f"{their_tower} tower"))
                elif their_floor >= floor:
                    problems.append((module, f"imports {target} (floor {their_floor}) from "
                                             f"floor {floor}"))
    return problems


def test_rooms_import_only_downward():
    assert upward_imports(PACKAGE) == []


def test_every_placed_room_is_a_module():
    present = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")}
    assert set(placement()) == present
    assert len(placement()) == sum(len(n) for n in FLOORS) + sum(len(n) for n in FACE) + sum(
        len(n) for floors in TOWERS.values() for n in floors)  # each placed once


@pytest.mark.parametrize("module,planted", [
    ("_units", "from .streaming import ParameterStream\n"),       # the stream's leaf calls up
    ("_ranges", "from ._window import Window\n"),                 # the seam reaches a tower
    ("_buckets", "from . import optimizer\n"),                    # a bucket reaches its owner
    ("_window", "def f():\n    from ._stream_hooks import StreamHooks\n"),  # inside a function
    ("_layout", "from ._verdict import Verdict\n"),               # sideways, on one floor
    ("_buckets", "from ._trace import Trace\n"),                  # the optimizer reaches across
    ("optimizer", "from .streaming import stream_of\n"),          # ... from its top floor
    ("streaming", "from ._state import OptimizerState\n"),        # the stream reaches across
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
    assert upward_imports(str(copy)) == [("_new_room", "is not placed in FLOORS, TOWERS or FACE")]
