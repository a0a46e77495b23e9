"""Descriptor validation shared by every transport: nothing is posted outside registered memory.

A real NIC checks remote keys, but only against everything the peer ever registered; we check
each span against the exact regions involved, so a buggy or hostile peer's offsets can never
make us read (local side) or write (remote side) memory that was not registered or granted
for this purpose (docs/failure-modes.md #15). Lookups are a bisect over region bases: O(log R) per
span.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from pd_transfer.errors import DescriptorError, DescriptorOutOfBounds, RegistrationError
from pd_transfer.transport.base import MemoryKind, RegisteredRegion, Span

__all__ = ["Placed", "RegionTable", "ValidatedWrite", "validate_write"]

Placed = tuple[int, int, int]
"""A descriptor ready for the backend: ``(address, length_bytes, device_id)``."""


class RegionTable:
    """Non-overlapping regions of one address space, sorted by base address."""

    def __init__(self, regions: Iterable[RegisteredRegion] = ()) -> None:
        self._bases: list[int] = []
        self._regions: list[RegisteredRegion] = []
        for region in regions:
            self.add(region)

    def __len__(self) -> int:
        return len(self._regions)

    def __iter__(self) -> Iterator[RegisteredRegion]:
        return iter(list(self._regions))

    def add(self, region: RegisteredRegion) -> None:
        """Insert ``region``; raises RegistrationError on a duplicate name or any overlap."""
        if any(r.name == region.name for r in self._regions):
            raise RegistrationError(f"a region named {region.name!r} is already registered")
        i = bisect.bisect_right(self._bases, region.base_address)
        neighbours = self._regions[max(i - 1, 0) : i + 1]
        for other in neighbours:
            if other.base_address < region.end_address and region.base_address < other.end_address:
                raise RegistrationError(
                    f"region {region.name!r} [{region.base_address:#x}, "
                    f"{region.end_address:#x}) overlaps registered region {other.name!r} "
                    f"[{other.base_address:#x}, {other.end_address:#x}); register disjoint "
                    f"buffers, or one buffer once"
                )
        self._bases.insert(i, region.base_address)
        self._regions.insert(i, region)

    def remove(self, region: RegisteredRegion) -> bool:
        """Drop ``region``; False if it was not present."""
        try:
            i = self._regions.index(region)
        except ValueError:
            return False
        del self._bases[i]
        del self._regions[i]
        return True

    def find(self, address: int, length: int) -> RegisteredRegion | None:
        """The region holding all of ``[address, address + length)``, else None.

        Regions never overlap (``add`` refuses it; CUDA's unified addressing gives host and
        device memory distinct virtual addresses), so only the region with the highest base
        at or below ``address`` can hold the span.
        """
        i = bisect.bisect_right(self._bases, address) - 1
        if i >= 0 and self._regions[i].contains(address, length):
            return self._regions[i]
        return None


@dataclass(frozen=True)
class ValidatedWrite:
    """A write whose every span was matched to a region; safe to hand to the backend."""

    local: tuple[Placed, ...]
    remote: tuple[Placed, ...]
    local_kind: MemoryKind
    remote_kind: MemoryKind
    total_bytes: int


def _place(
    spans: Sequence[Span], table: RegionTable, side: str, hint: str
) -> tuple[tuple[Placed, ...], MemoryKind]:
    placed: list[Placed] = []
    kind: MemoryKind | None = None
    for index, (address, length) in enumerate(spans):
        if length <= 0:
            raise DescriptorError(f"{side} descriptor #{index} has length {length}; must be > 0")
        region = table.find(address, length)
        if region is None:
            raise DescriptorOutOfBounds(
                f"{side} descriptor #{index} [{address:#x}, {address + length:#x}) "
                f"({length} bytes) is not inside any {hint}; nothing was posted"
            )
        if kind is None:
            kind = region.kind
        elif region.kind is not kind:
            raise DescriptorError(
                f"{side} descriptors mix {kind.value} and {region.kind.value} memory "
                f"(#{index} is in {region.name!r}); post one write per memory kind"
            )
        placed.append((address, length, region.device_id))
    assert kind is not None  # spans is non-empty: checked by the caller
    return tuple(placed), kind


def validate_write(
    local: Sequence[Span],
    remote: Sequence[Span],
    local_regions: RegionTable,
    remote_regions: Sequence[RegisteredRegion],
) -> ValidatedWrite:
    """Match each span to its region or raise DescriptorError / DescriptorOutOfBounds."""
    if not local or len(local) != len(remote):
        raise DescriptorError(
            f"a write needs the same non-zero number of local and remote descriptors, got "
            f"{len(local)} local and {len(remote)} remote"
        )
    for index, ((_, local_len), (_, remote_len)) in enumerate(zip(local, remote, strict=True)):
        if local_len != remote_len:
            raise DescriptorError(
                f"descriptor pair #{index}: local length {local_len} != remote length "
                f"{remote_len}; pairs must match byte for byte"
            )
    placed_local, local_kind = _place(local, local_regions, "local", "locally registered region")
    placed_remote, remote_kind = _place(
        remote, RegionTable(remote_regions), "remote", "region the peer granted"
    )
    return ValidatedWrite(
        local=placed_local,
        remote=placed_remote,
        local_kind=local_kind,
        remote_kind=remote_kind,
        total_bytes=sum(length for _, length in local),
    )
