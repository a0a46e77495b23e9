"""The operator in-process under kopf's test runner, leaving no sockets behind."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kopf.testing import KopfRunner


@contextmanager
def kopf_runner(args: Sequence[str], timeout: float) -> Iterator[KopfRunner]:
    """Run kopf with `args` for the duration of the block.

    kopf's runner leaves its HTTP connections to the garbage collector when it stops; with
    warnings as errors, the ResourceWarning would then fail whichever later test happened to
    trigger a collection. Collect them here, where they belong.
    """
    try:
        with KopfRunner(list(args), timeout=timeout) as runner:
            yield runner
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
