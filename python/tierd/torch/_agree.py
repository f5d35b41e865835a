"""Every rank's outcome of something only some ranks may fail (a node without a daemon, a rank
with another model): raised on every rank, naming each rank that failed, so that no rank goes on
into a collective a failed one never reaches."""
import socket
from typing import Optional

import torch.distributed as dist

from .._errors import FailedPrecondition


def all_succeeded(group, who: str, doing: str, error: Optional[BaseException]) -> None:
    """Gathers every rank's outcome of `doing` over `group` (a gloo group of every rank) and
    raises on every rank when any failed: a failed rank its own error, with the others' named in
    its note; the others a RuntimeError naming each failed rank, its node and its error."""
    mine = None if error is None else f"rank {dist.get_rank()} on {socket.gethostname()}: {error}"
    outcomes = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, mine, group=group)
    failed = [o for o in outcomes if o is not None]
    if not failed:
        return
    summary = f"{who}: could not {doing} on every rank; " + "; ".join(failed)
    if error is not None:
        if hasattr(error, "add_note"):  # Python 3.11
            error.add_note(summary)
        raise error
    raise FailedPrecondition(summary)
