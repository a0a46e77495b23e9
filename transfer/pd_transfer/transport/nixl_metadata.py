"""Checks on NIXL agent metadata before NIXL sees it: size, framing, the agent name.

UCX aborts the process on some malformed connection blobs (docs/failure-modes.md #26), so
``NixlTransport.add_peer`` runs ``parse_nixl_metadata`` first. No ``nixl`` import: the format
is read from the bytes. Measured with nixl 1.5.1 (``get_agent_metadata``), the blob is NIXL's
``nixlSerDes`` stream: a header, then records ``tag | u64 LE length | value | b"|"``::

    b"nixlSerDes|"
    b"Agent" len name "|"                  the agent name, first record
    b"Conns" 8 count "|"                   count (u64) backends follow, each:
        b"t" len backend "|"                 its name (b"UCX")
        b"c" len conn-info "|"               its connection blob (the UCX worker address)
    b"" 10 b"MemSection" "|"               the memory sections' marker
    b"nixlSecElms" 8 count "|"             count (u64) sections follow, each:
        b"bknd" len backend "|"              a backend with a connection above
        b"nixlDList" 10 b"nixlSDList" "|"
        b"t" 4 mem-type "|"                  u32: 0 DRAM, 1 VRAM
        b"n" 8 count "|"                     count (u64) descriptors follow, each:
            b"" len (address, length, device: 3 × u64) remote-key "|"
    (end of blob)

Checked: every record's tag, length bounds and ``|`` terminator, nothing after the last
section, the agent name (printable ASCII, equal to the name the authenticated sender claims),
backend names, memory types, descriptor counts and ranges. Not checkable: the bytes inside a
connection blob and a remote key (UCX's own formats; a mutated byte there can make UCX abort
or segfault). Those reach NIXL only from an authenticated peer, and on a reload of a known
agent ``NixlTransport`` requires the connection blob and the remote key of every region it
listed before to be unchanged, so only a newly registered region's key is new.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from pd_transfer.errors import TransportError

__all__ = [
    "MAX_METADATA_BYTES",
    "Descriptor",
    "MemorySection",
    "NixlMetadata",
    "parse_nixl_metadata",
]

MAX_METADATA_BYTES: Final = 1 << 20
MAX_CONNECTIONS: Final = 16
MAX_CONN_INFO_BYTES: Final = 64 * 1024
HEADER: Final = b"nixlSerDes|"
_MEM_SECTION: Final = b"MemSection"
MAX_SECTIONS: Final = 16
MAX_DESCRIPTORS: Final = 4096
MAX_DESCRIPTOR_BYTES: Final = 4096
MAX_DEVICE: Final = 1023
_U64: Final = struct.Struct("<Q")
_U32: Final = struct.Struct("<I")
_DESC: Final = struct.Struct("<QQQ")  # address, length, device id; the remote key follows
_MEM_KINDS: Final = {0: "DRAM", 1: "VRAM"}  # NIXL's DRAM_SEG / VRAM_SEG


@dataclass(frozen=True)
class Descriptor:
    """One registered region as a peer's metadata lists it."""

    address: int
    length: int
    device: int
    backend_key: bytes  # the backend's remote key (UCX rkey): opaque, not checkable here


@dataclass(frozen=True)
class MemorySection:
    backend: str
    kind: str  # "DRAM" or "VRAM"
    descriptors: tuple[Descriptor, ...]


@dataclass(frozen=True)
class NixlMetadata:
    """What a checked metadata blob says."""

    agent_name: str
    connections: tuple[tuple[str, bytes], ...]  # (backend, connection blob)
    sections: tuple[MemorySection, ...]

    def backend_keys(self) -> dict[tuple[str, str, int, int, int], bytes]:
        """Each region's remote key by (backend, kind, address, length, device)."""
        return {(s.backend, s.kind, d.address, d.length, d.device): d.backend_key
                for s in self.sections for d in s.descriptors}


class _Reader:
    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.pos = 0

    def record(self, tag: bytes, max_len: int) -> bytes:
        blob, start = self.blob, self.pos
        if blob[start:start + len(tag)] != tag:
            raise self.error(f"expected record {tag!r} at byte {start}")
        at = start + len(tag)
        if at + _U64.size > len(blob):
            raise self.error(f"record {tag!r} at byte {start} is cut short")
        (length,) = _U64.unpack_from(blob, at)
        at += _U64.size
        if length > max_len or at + length + 1 > len(blob):
            raise self.error(
                f"record {tag!r} at byte {start} claims {length} bytes (at most {max_len}, "
                f"{len(blob) - at - 1} left)")
        value = blob[at:at + length]
        if blob[at + length:at + length + 1] != b"|":
            raise self.error(f"record {tag!r} at byte {start} lacks its '|' terminator")
        self.pos = at + length + 1
        return value

    def error(self, what: str) -> TransportError:
        return TransportError(f"malformed NIXL metadata ({len(self.blob)} bytes): {what}")


def _ascii_name(raw: bytes, what: str, reader: _Reader) -> str:
    if not raw or any(byte < 0x21 or byte > 0x7E for byte in raw):
        raise reader.error(f"{what} {raw[:64]!r} is not printable ASCII without spaces")
    return raw.decode("ascii")


def parse_nixl_metadata(blob: bytes, expected_name: str) -> NixlMetadata:
    """Check ``blob`` (module docstring) and that it names ``expected_name``; TransportError
    naming the first problem otherwise."""
    if not len(HEADER) < len(blob) <= MAX_METADATA_BYTES:
        raise TransportError(
            f"NIXL metadata of {len(blob)} bytes; expected more than {len(HEADER)} and at most "
            f"{MAX_METADATA_BYTES}")
    reader = _Reader(blob)
    if not blob.startswith(HEADER):
        raise reader.error(f"it does not start with {HEADER!r}")
    reader.pos = len(HEADER)
    name = _ascii_name(reader.record(b"Agent", 1024), "the agent name", reader)
    if name != expected_name:
        raise TransportError(
            f"NIXL metadata names agent {name!r} but its authenticated sender is "
            f"{expected_name!r}: refused before NIXL loads it")
    count_raw = reader.record(b"Conns", _U64.size)
    if len(count_raw) != _U64.size:
        raise reader.error(f"the connection count has {len(count_raw)} bytes, not 8")
    (count,) = _U64.unpack(count_raw)
    if not 1 <= count <= MAX_CONNECTIONS:
        raise reader.error(f"{count} backend connections (expected 1 to {MAX_CONNECTIONS})")
    connections = []
    for _ in range(count):
        backend = _ascii_name(reader.record(b"t", 64), "a backend name", reader)
        connections.append((backend, reader.record(b"c", MAX_CONN_INFO_BYTES)))
    if reader.record(b"", len(_MEM_SECTION)) != _MEM_SECTION:
        raise reader.error("the memory section marker does not follow the connections")
    backends = {backend for backend, _ in connections}
    sections = tuple(_section(reader, backends)
                     for _ in range(_count(reader, b"nixlSecElms", MAX_SECTIONS)))
    if reader.pos != len(blob):
        raise reader.error(f"{len(blob) - reader.pos} bytes follow the last memory section")
    return NixlMetadata(name, tuple(connections), sections)


def _count(reader: _Reader, tag: bytes, limit: int) -> int:
    raw = reader.record(tag, _U64.size)
    if len(raw) != _U64.size:
        raise reader.error(f"the {tag.decode()} count has {len(raw)} bytes, not 8")
    (count,) = _U64.unpack(raw)
    if count > limit:
        raise reader.error(f"{tag.decode()} count {count} is over {limit}")
    return int(count)


def _section(reader: _Reader, backends: set[str]) -> MemorySection:
    backend = _ascii_name(reader.record(b"bknd", 64), "a section's backend", reader)
    if backend not in backends:
        raise reader.error(f"a memory section of backend {backend!r}, which has no connection")
    if reader.record(b"nixlDList", 16) != b"nixlSDList":
        raise reader.error("a memory section lacks its descriptor list marker")
    kind_raw = reader.record(b"t", 4)
    kind = _U32.unpack(kind_raw)[0] if len(kind_raw) == _U32.size else -1
    if kind not in _MEM_KINDS:
        raise reader.error(f"memory type {kind_raw.hex()} (only DRAM 0 and VRAM 1 are served)")
    descriptors = []
    for _ in range(_count(reader, b"n", MAX_DESCRIPTORS)):
        raw = reader.record(b"", MAX_DESCRIPTOR_BYTES)
        if len(raw) < _DESC.size:
            raise reader.error(f"a descriptor of {len(raw)} bytes (at least {_DESC.size})")
        address, length, device = _DESC.unpack_from(raw)
        if address == 0 or length == 0 or address + length > 1 << 64 or device > MAX_DEVICE:
            raise reader.error(
                f"descriptor [{address:#x}, +{length}) on device {device} is not a region")
        descriptors.append(Descriptor(address, length, device, raw[_DESC.size:]))
    return MemorySection(backend, _MEM_KINDS[kind], tuple(descriptors))
