"""OffloadedAdamW checkpoints that move between nodes and world sizes.

An optimizer sharded over ranks (ZeRO-1) keeps each rank's share of the state in that rank's
node's daemon. `save` writes each rank's share (its state_dict) to a file of its own in one
directory; `load`, in a job of any number of ranks on any nodes, has each rank read every file and
keep the entries of the parameters it owns under the new sharding, so the state is resharded on
load. A rank holds at most its new share plus one old file's at a time.

    directory/optimizer.rank<r>of<n>.pt   {"format", "rank", "world", "node", "state_name",
                                           "param_groups" (JSON), "state"}

Files hold tensors and plain values only, and are read with torch.load(weights_only=True): a
checkpoint file is not trusted to run code (the groups are JSON, as torch 1.13's safe loader
takes no floats).

A file is written whole or not at all (a temporary file, synced, then renamed), and `load`
refuses a directory whose files do not all come from one save of one job.
"""
import glob
import json
import os
import re
import socket
from typing import Any, Callable, Dict, Set

import torch

FORMAT = 1
_NAME = re.compile(r"optimizer\.rank(\d+)of(\d+)\.pt$")


def shard_path(directory: str, rank: int, world: int) -> str:
    return os.path.join(directory, f"optimizer.rank{rank}of{world}.pt")


def save(directory: str, rank: int, world: int, state_name: str,
         state_dict: Dict[str, Any]) -> str:
    """Writes this rank's share; returns its file."""
    os.makedirs(directory, exist_ok=True)
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
    return path


def load(directory: str, owned: Callable[[int], bool]) -> Dict[str, Any]:
    """The state_dict to load on a rank that owns the parameters (state_dict indices) for which
    `owned` is true: their entries from whichever file holds them, and of every other parameter
    only its step count (so that every rank agrees on the steps taken)."""
    files = {}
    for path in glob.glob(os.path.join(directory, "optimizer.rank*of*.pt")):
        m = _NAME.search(os.path.basename(path))
        if m:
            files[(int(m.group(1)), int(m.group(2)))] = path
    if not files:
        raise FileNotFoundError(f"no optimizer checkpoint in {directory}: save_checkpoint writes "
                                "optimizer.rank<r>of<n>.pt there, one file per rank")
    worlds = sorted({w for _, w in files})
    if len(worlds) > 1:
        raise ValueError(f"{directory} holds the shards of jobs of {worlds} ranks: keep the files "
                         "of one save only")
    world = worlds[0]
    missing = sorted(set(range(world)) - {r for r, _ in files})
    if missing:
        raise FileNotFoundError(
            f"{directory} is a checkpoint of {world} ranks, but the files of rank(s) "
            f"{', '.join(map(str, missing))} are not there: copy every rank's file "
            f"(optimizer.rank<r>of{world}.pt) from the nodes that saved them")
    state: Dict[int, Dict[str, Any]] = {}
    groups = None
    seen: Set[int] = set()
    for rank in range(world):
        data = torch.load(files[(rank, world)], map_location="cpu", weights_only=True)
        if data.get("format") != FORMAT or data.get("rank") != rank or data.get("world") != world:
            raise ValueError(f"{files[(rank, world)]} is not rank {rank} of {world}'s shard of an "
                             f"optimizer checkpoint (format {FORMAT})")
        saved_groups = json.loads(data["param_groups"])
        if groups is None:
            groups = saved_groups
        elif groups != saved_groups:
            raise ValueError(f"the shards in {directory} disagree on the parameter groups: they "
                             "are not from one save of one job")
        for index, entry in data["state"].items():
            if index in seen:
                raise ValueError(f"parameter {index}'s state is in two shards in {directory}")
            seen.add(index)
            if owned(index):
                state[index] = entry
            elif "step" in entry:
                state[index] = {"step": entry["step"]}
        del data
    return {"state": state, "param_groups": groups}
