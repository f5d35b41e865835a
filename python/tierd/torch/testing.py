"""Hooks for tierd's own tests: behaviour no training job asks for.

    stream = tierd.torch.testing.poison(tierd.torch.stream_parameters(model, ...))
"""
from .streaming import ParameterStream


def poison(stream: ParameterStream) -> ParameterStream:
    """Makes the stream's released device storage NaN and delays its copies on a thread, so that
    a read of a unit's weights before their copy has landed shows up as NaN. Returns the stream."""
    stream._window.poison = True
    return stream
