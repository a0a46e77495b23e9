"""Prometheus exposition text as plain data: families, summed samples, histograms, quantiles.

Pure (no I/O, no clock). The text is parsed with ``prometheus_client.parser``, which names a
counter family without its ``_total`` suffix (``vllm:nixl_num_failed_transfers`` for samples
``vllm:nixl_num_failed_transfers_total``) and a histogram family without ``_bucket`` /
``_count`` / ``_sum``; the mapping tables use those family names. ``families_of`` takes a
collector's own metric families the same way (an agent in its engine's process reads them
without a scrape).

Every reader of an engine's metrics uses this module: the engine-native agent
(``pd_transfer.native``, which re-exports it), the engines' requests every agent reports
(``engine_load``) and the drain hook.

Values are summed over an engine's label sets (vLLM's ``engine`` index, SGLang's
``tp_rank`` / ``dp_rank``...), after a mapping's label filter (e.g. SGLang's
``stage="decode_transferred"``), so one pod is one number whatever its parallelism.

``Histogram.quantile`` estimates a quantile the way PromQL's ``histogram_quantile`` does:
linear within the bucket the rank falls in; a rank in the open ``+Inf`` bucket gives the
highest finite bound (nothing larger can be said).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pd_transfer.agent.errors import MappingError

__all__ = ["Family", "Histogram", "families_of", "gauge_sum", "histogram_of",
           "parse_exposition", "sample_sum"]

_MAX_ERROR_CHARS = 200


@dataclass(frozen=True)
class Family:
    """One metric family of the text: its parsed name, type and samples."""

    name: str
    type: str
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (``math.inf`` last), the count and the sum."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    @staticmethod
    def empty() -> Histogram:
        return Histogram((), 0.0, 0.0)

    def scaled(self, factor: float) -> Histogram:
        """Bounds and sum in another unit (milliseconds → seconds: ``factor=0.001``)."""
        return Histogram(tuple((bound * factor, n) for bound, n in self.buckets), self.count,
                         self.sum * factor)

    def plus(self, other: Histogram) -> Histogram:
        """Bucket-wise sum (bounds of either side; a bound one side lacks counts as that
        side's next larger bound, which is what a cumulative count means)."""
        bounds = sorted({b for b, _ in self.buckets} | {b for b, _ in other.buckets})
        return Histogram(tuple((b, self.at(b) + other.at(b)) for b in bounds),
                         self.count + other.count, self.sum + other.sum)

    def minus(self, earlier: Histogram) -> Histogram:
        """What was observed since ``earlier`` (never negative)."""
        bounds = sorted({b for b, _ in self.buckets} | {b for b, _ in earlier.buckets})
        return Histogram(tuple((b, max(0.0, self.at(b) - earlier.at(b))) for b in bounds),
                         max(0.0, self.count - earlier.count), max(0.0, self.sum - earlier.sum))

    def at(self, bound: float) -> float:
        """Cumulative count of observations <= ``bound``."""
        below = 0.0
        for b, n in self.buckets:
            if b > bound:
                break
            below = n
        return below

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1), None when nothing was observed."""
        total = self.buckets[-1][1] if self.buckets else 0.0
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank and cumulative > below:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, cumulative
        return lower


def families_of(metrics: Iterable[Metric]) -> dict[str, Family]:
    """Families by name, from prometheus_client's metric families (parsed text, or what a
    collector yields)."""
    return {m.name: Family(m.name, m.type, tuple(m.samples)) for m in metrics}


def parse_exposition(text: str) -> dict[str, Family]:
    """Families by parsed name; MappingError when the text is not exposition format."""
    try:
        return families_of(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise MappingError(f"the engine's metrics are not Prometheus exposition text: "
                           f"{str(exc)[:_MAX_ERROR_CHARS]}") from exc


def _matches(labels: Mapping[str, str], wanted: Iterable[tuple[str, str]]) -> bool:
    """An empty wanted value also matches a missing label (Prometheus treats them alike)."""
    return all(labels.get(key, "") == value for key, value in wanted)


def sample_sum(family: Family, sample_name: str,
               wanted: Iterable[tuple[str, str]] = ()) -> float | None:
    """Sum of the samples named ``sample_name`` whose labels match ``wanted``; None when
    there is none (a labelled metric no label set of which was created yet)."""
    wanted = tuple(wanted)
    values = [s.value for s in family.samples
              if s.name == sample_name and _matches(s.labels, wanted)]
    return math.fsum(values) if values else None


def gauge_sum(family: Family, wanted: Iterable[tuple[str, str]] = ()) -> float | None:
    return sample_sum(family, family.name, wanted)


def histogram_of(family: Family, wanted: Iterable[tuple[str, str]] = ()) -> Histogram | None:
    """The family's buckets, count and sum over the matching label sets; None when no label
    set matches."""
    wanted = tuple(wanted)
    buckets: dict[float, float] = {}
    count = total = 0.0
    seen = False
    for s in family.samples:
        if not _matches(s.labels, wanted):
            continue
        if s.name == family.name + "_bucket":
            bound = float(s.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + s.value
            seen = True
        elif s.name == family.name + "_count":
            count += s.value
            seen = True
        elif s.name == family.name + "_sum":
            total += s.value
    if not seen:
        return None
    return Histogram(tuple(sorted(buckets.items())), count, total)
