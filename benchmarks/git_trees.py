"""A checkout of another commit, for the benchmarks that measure before and after in one run
(`rollout_under_load.py --before/--upgrade-from`, `first_contact.py --before`)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """A detached git worktree of `ref` (removed after)."""
    path = Path(tempfile.mkdtemp(prefix="before-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path),
                    ref], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                       check=False)
