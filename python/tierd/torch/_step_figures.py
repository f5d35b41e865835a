"""tierd's figures of each training step, for the logs a run is read in (TensorBoard, Weights &
Biases, a plain print):

    figures = tierd.torch.StepFigures(opt)
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        log({"loss": loss.item(), **figures.take()})

take() gives the figures under the names below (prefixed "tierd/"): the counters as means a step
over the optimizer steps since the last take(), the optimizer's times those of its last step, the
host tier's use as it is when taken; an empty dict when no step was taken since.
transformers: tierd.torch.hf.Trainer logs them itself, and tierd.torch.hf.log_figures(trainer)
adds them to any other Trainer (TRL's SFTTrainer).

- nvme_read_bytes, nvme_written_bytes: bytes the node's daemon moved from NVMe into host memory
  and back, every job on the node together (one job's own, where it trains alone);
- host_tier_used_bytes: the daemon's host tier in use when taken, every job's;
- weights_wait_s: the time compute waited for streamed weights (stream_parameters);
- h2d_bytes, d2h_bytes: streamed weights copied to the device, gradients copied off it;
- optimizer_tail_s: the time the last step() took after backward (what the optimizer adds to a
  step);
- optimizer_state_wait_s: the time the last step waited for its state (at home on NVMe).

The stream's figures are there when the optimizer's parameters are streamed; the daemon's when it
can be reached (on the optimizer's socket_dir).
"""
from typing import Dict, Optional

from .._errors import InvalidType
from ..client import Client, Tier, TierdError, connect
from .optimizer import OffloadedAdamW
from .streaming import ParameterStream, stream_of

__all__ = ["StepFigures"]

PREFIX = "tierd/"
_PATHS = {"nvme_read_bytes": "nvme_to_host", "nvme_written_bytes": "host_to_nvme"}
_STREAMED = {"weights_wait_s": "wait_s", "h2d_bytes": "h2d_bytes", "d2h_bytes": "d2h_bytes"}
_STEPPED = {"optimizer_tail_s": "tail_s", "optimizer_state_wait_s": "state_wait_s"}


class StepFigures:
    """The figures of `optimizer`'s steps (see the module's text); `stream`: the stream of its
    parameters (default: found from them). close() ends its session with the daemon."""

    def __init__(self, optimizer: OffloadedAdamW, stream: Optional[ParameterStream] = None):
        if not isinstance(optimizer, OffloadedAdamW):
            raise InvalidType(f"StepFigures: figures of an OffloadedAdamW, not "
                              f"{type(optimizer).__name__}")
        self.optimizer = optimizer
        self.stream = stream if stream is not None else stream_of_params(
            p for group in optimizer.param_groups for p in group["params"])
        self._client: Optional[Client] = None
        try:
            self._client = connect(optimizer.socket_dir, "figures")
        except TierdError:
            pass  # the daemon's figures are left out
        self._last = self._totals()

    def _steps(self) -> int:
        return self.optimizer.steps_taken + self.optimizer.skipped_steps

    def _totals(self) -> Dict[str, float]:
        """The counters that only grow, now."""
        now = {"steps": float(self._steps())}
        if self._client is not None and not self._client.closed:
            for name, path in _PATHS.items():
                now[name] = float(self._client.path_bytes(path))
        if self.stream is not None and not self.stream.closed:
            stats = self.stream.stats
            for name, key in _STREAMED.items():
                now[name] = float(stats[key])
        return now

    def take(self) -> Dict[str, float]:
        """The figures a step since the last take() (means over the steps taken since)."""
        now = self._totals()
        last, self._last = self._last, now
        steps = now["steps"] - last["steps"]
        if steps <= 0:
            return {}
        out = {PREFIX + k: (v - last[k]) / steps for k, v in now.items()
               if k != "steps" and k in last}
        stats = self.optimizer.last_stats or {}
        for name, key in _STEPPED.items():
            if key in stats:
                out[PREFIX + name] = float(stats[key])
        if self._client is not None and not self._client.closed:
            out[PREFIX + "host_tier_used_bytes"] = float(
                self._client.tier_usage(Tier.HOST).used_bytes)
        return out

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> "StepFigures":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream_of_params(params) -> Optional[ParameterStream]:
    """The open stream that streams one of `params`, if any."""
    return next((s for s in map(stream_of, params) if s is not None), None)
