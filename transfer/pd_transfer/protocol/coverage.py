"""Which (layer, page) cells of one writer's share of a request its parts have covered.

A request promises, per writer (a prefill rank's head slice into one decode rank), every
layer of the plan × every page of the request. Each part claims a rectangle ``layers ×
pages`` of that; a claim outside the promise, empty, or overlapping an earlier claim is
refused (``CoverageError``) and changes nothing, so a completed coverage means every cell
landed exactly once (docs/failure-modes.md #28). One bitmask of pages per layer: a claim
costs one big-integer operation per layer, whatever the number of parts. No I/O here.
"""

from __future__ import annotations

__all__ = ["Coverage", "CoverageError"]


class CoverageError(ValueError):
    """A part's layers × pages cannot be claimed (outside the promise, empty, overlapping)."""


class Coverage:
    """The cells of ``layers`` (global layer numbers) × pages ``[0, num_pages)`` claimed so
    far, each at most once."""

    def __init__(self, layers: range, num_pages: int) -> None:
        if not layers or layers.step != 1 or num_pages <= 0:
            raise ValueError(f"a coverage needs layers and pages, got {layers} × {num_pages}")
        self.layers = layers
        self.num_pages = num_pages
        self._full = (1 << num_pages) - 1
        self._claimed = [0] * len(layers)  # per layer: bit p set = page p covered

    def claim(self, layers: range, pages: range) -> None:
        """Mark ``layers × pages`` covered; raises CoverageError (nothing marked) if any of
        it is empty, outside the promise or covered already."""
        if not layers or not pages or layers.step != 1 or pages.step != 1:
            raise CoverageError(f"layers {_span(layers)} × pages {_span(pages)} is empty")
        if (layers.start < self.layers.start or layers.stop > self.layers.stop
                or pages.start < 0 or pages.stop > self.num_pages):
            raise CoverageError(
                f"layers {_span(layers)} × pages {_span(pages)} is outside the promised "
                f"layers {_span(self.layers)} × pages [0, {self.num_pages})")
        mask = ((1 << len(pages)) - 1) << pages.start
        rows = range(layers.start - self.layers.start, layers.stop - self.layers.start)
        overlap = [self.layers.start + row for row in rows if self._claimed[row] & mask]
        if overlap:
            raise CoverageError(
                f"layers {_span(layers)} × pages {_span(pages)} overlaps cells already "
                f"covered (in layers {_runs(overlap)})")
        for row in rows:
            self._claimed[row] |= mask

    @property
    def complete(self) -> bool:
        return all(row == self._full for row in self._claimed)

    def missing(self) -> str:
        """The uncovered cells, grouped: ``"pages [1, 4) of layers [0, 2)"``; "" if none."""
        groups: list[tuple[range, int]] = []  # (layers, missing-page mask), adjacent merged
        for row, claimed in enumerate(self._claimed):
            gap, layer = self._full & ~claimed, self.layers.start + row
            if groups and groups[-1][1] == gap and groups[-1][0].stop == layer:
                groups[-1] = (range(groups[-1][0].start, layer + 1), gap)
            else:
                groups.append((range(layer, layer + 1), gap))
        return "; ".join(f"pages {_runs(_bits(gap))} of layers {_span(layers)}"
                         for layers, gap in groups if gap)


def _bits(mask: int) -> list[int]:
    return [bit for bit in range(mask.bit_length()) if mask >> bit & 1]


def _span(values: range) -> str:
    return f"[{values.start}, {values.stop})"


def _runs(values: list[int]) -> str:
    """``[1, 2, 3, 7]`` → ``"[1, 4), [7, 8)"``."""
    runs: list[range] = []
    for value in values:
        if runs and runs[-1].stop == value:
            runs[-1] = range(runs[-1].start, value + 1)
        else:
            runs.append(range(value, value + 1))
    return ", ".join(_span(run) for run in runs)
