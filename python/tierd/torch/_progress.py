"""Progress bars for what can take minutes (a checkpoint imported or saved, a shared base's first
fill), as transformers shows one while it loads checkpoint shards: tqdm's, on standard error, in
bytes with their rate.

`progress`: True shows the bar at once; False never; None (the default) shows it when standard
error is a terminal and the work lasts more than a moment (DELAY_S), unless TIERD_PROGRESS=0 is in
the environment. Without tqdm (a dependency of transformers) there is no bar.

Bar or not, the work's bytes, time and rate go to the `tierd` logger (INFO) once it is done.
"""
import contextlib
import logging
import os
import sys
import time
from typing import Callable, Iterator, Optional

from .._sizes import size_text

DELAY_S = 1.0  # what "more than a moment" is, when the bar is not asked for

log = logging.getLogger(__name__)


def wanted(progress: Optional[bool]) -> bool:
    """Whether a bar is shown for `progress` (see the module's text)."""
    if progress is not None:
        return bool(progress)
    if os.environ.get("TIERD_PROGRESS", "").strip() == "0":
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


@contextlib.contextmanager
def bar(what: str, total: int, progress: Optional[bool]) -> Iterator[Callable[[int], None]]:
    """Yields a function that counts bytes done towards `total`, shown as a bar named `what`
    where `progress` says so; closed, finished or not, when the block ends, and logged when it
    finishes."""
    if total <= 0:
        yield lambda n: None
        return
    start, counted = time.monotonic(), [0]
    with _shown(what, total, progress) as show:
        def done(n: int) -> None:
            counted[0] += n
            show(n)
        yield done
    seconds = time.monotonic() - start
    log.info("%s: %s in %.2f s (%s/s)", what, size_text(counted[0]), seconds,
             size_text(counted[0] / max(seconds, 1e-9)))


@contextlib.contextmanager
def _shown(what: str, total: int, progress: Optional[bool]) -> Iterator[Callable[[int], None]]:
    if not wanted(progress):
        yield lambda n: None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield lambda n: None
        return
    with tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, delay=0 if progress else DELAY_S) as shown:
        yield shown.update

