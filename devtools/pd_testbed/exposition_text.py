"""Prometheus exposition text cut down to some metric families: what the engine-native
agent's captures (`captures/vllm_nixl_metrics.py`, `captures/sglang_metrics.py`) keep."""

from __future__ import annotations

__all__ = ["trim"]


def trim(text: str, keep: tuple[str, ...]) -> str:
    """The `# HELP`/`# TYPE` lines and samples of the families whose names start with one
    of `keep`, in their order; other comments and blank lines dropped."""
    kept: list[str] = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            name = line.split()[2]
        elif line.startswith("#") or not line.strip():
            continue
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith(keep):
            kept.append(line)
    return "\n".join(kept) + "\n"
