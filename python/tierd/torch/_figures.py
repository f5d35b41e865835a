"""A stream's counters since it was made, each with one room that counts it; ParameterStream.stats
shows them, with the figures it reads at the time (peak bytes, the node's NVMe reads)."""
import dataclasses
from typing import Dict


@dataclasses.dataclass
class StreamFigures:
    fetches: int = 0        # units copied into the window (_window)
    on_demand: int = 0      # of them, not prefetched when asked for (_window)
    over_window: int = 0    # fetched past the window's size, every unit in it in use (_window)
    h2d_bytes: int = 0      # weights copied to the device (_window)
    wait_s: float = 0.0     # compute waiting for weights (_window)
    d2h_bytes: int = 0      # gradients sent off the device (_ranges)
    trace_misses: int = 0   # units used out of the trace's turn (_trace)
    iterations: int = 0     # training iterations traced (_trace)
    schedules: int = 0      # times the trace was declared to the daemon (_trace)

    def as_dict(self) -> Dict[str, float]:
        return dataclasses.asdict(self)
