"""The operator process's exit grace (`handlers.exit_after`), in a process of its own: once
kopf has begun stopping, a stop that hangs (kopf waiting forever for watchers stuck in their
own cancellation, failure-modes #52) still ends the process, with a failure code."""

from __future__ import annotations

import subprocess
import sys
import time

from pd_testbed.checkout import REPO_ROOT

# A process that starts the grace as kopf's cleanup does, then hangs as a stuck stop does.
HANGING_STOP = """
import threading, time
from pd_operator.handlers import exit_after
exit_after(0.5)
threading.Event().wait(60)
"""


def test_a_stop_that_hangs_ends_the_process_after_its_grace() -> None:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HANGING_STOP], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=30, check=False)
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert "the operator did not finish stopping within 0.5 s; exiting" in done.stderr
    assert elapsed < 20  # the grace, not the 60 s hang (imports take a few seconds)
