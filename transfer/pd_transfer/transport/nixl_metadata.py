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
        b"n" 8 count "|"                     count (u64) descriptors follow, at least one:
            b"" len (address, length, device: 3 × u64) remote-key "|"
    (end of blob)

Checked: every record's tag, length bounds and ``|`` terminator, nothing after the last
section, the agent name (printable ASCII, equal to the name the authenticated sender claims),
backend names, memory types, descriptor counts and ranges, and the framing of each UCX remote
key (``_check_ucx_rkey``): NIXL hands UCX a key without its length, so UCX reads as far as
the key's own fields say, and indexes tables with its memory type. On a reload of a known
agent (``check_reload``) its connection blob and the remote key of every region it listed
before must be unchanged, so UCX only ever sees a new agent's blob or a new region's key for
the first time (``unseen_parts``).

Not checkable here: the bytes inside a connection blob and the transports' own keys inside a
remote key (a mutated byte there can make UCX abort or segfault, or refuse the load, after
which NIXL 1.5.1 refuses every later load of that agent name). Those parts are loaded first
by a vetting process with its own NIXL agent (``nixl_vetter``), which dies in the engine's
stead; ``encode_nixl_metadata`` writes the blob it is given, and the blob the engine's NIXL
loads under a name of the engine's own (``nixl_admission``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Final

from pd_transfer.errors import TransportError

__all__ = [
    "MAX_METADATA_BYTES",
    "Descriptor",
    "MemorySection",
    "NixlMetadata",
    "check_reload",
    "encode_nixl_metadata",
    "parse_nixl_metadata",
    "unseen_parts",
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
_DLIST: Final = (b"nixlDList", b"nixlSDList")
# UCP's packed remote key (UCX >= 1.20; nixl 1.5.1 bundles UCX 1.23): u64 MD map, u8 memory
# type, per MD in the map a u8 size and that many bytes of the transport's key, then (MD map
# not empty) a u8 system device; a known device is followed by 3-byte distance entries, each
# naming another device, up to a 0xff terminator. Memory types: UCS_MEMORY_TYPE_HOST (0) up
# to UCS_MEMORY_TYPE_GAUDI (9); UCX indexes tables with it (measured: 0x80 segfaults).
_RKEY_HEAD: Final = struct.Struct("<QB")
_UCS_MEMORY_TYPES: Final = 10
_SYS_DEVICE_UNKNOWN: Final = 0xFF
_DISTANCE_BYTES: Final = 3
_RegionKey = tuple[str, str, int, int, int]  # backend, kind, address, length, device


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

    def backend_keys(self) -> dict[_RegionKey, bytes]:
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
    if reader.record(_DLIST[0], 16) != _DLIST[1]:
        raise reader.error("a memory section lacks its descriptor list marker")
    kind_raw = reader.record(b"t", 4)
    kind = _U32.unpack(kind_raw)[0] if len(kind_raw) == _U32.size else -1
    if kind not in _MEM_KINDS:
        raise reader.error(f"memory type {kind_raw.hex()} (only DRAM 0 and VRAM 1 are served)")
    count = _count(reader, b"n", MAX_DESCRIPTORS)
    if count == 0:  # NIXL refuses it (NIXL_ERR_NOT_FOUND) after loading the connection
        raise reader.error(f"a {_MEM_KINDS[kind]} memory section of backend {backend!r} lists "
                           f"no descriptor")
    descriptors = []
    for _ in range(count):
        raw = reader.record(b"", MAX_DESCRIPTOR_BYTES)
        if len(raw) < _DESC.size:
            raise reader.error(f"a descriptor of {len(raw)} bytes (at least {_DESC.size})")
        address, length, device = _DESC.unpack_from(raw)
        if address == 0 or length == 0 or address + length > 1 << 64 or device > MAX_DEVICE:
            raise reader.error(
                f"descriptor [{address:#x}, +{length}) on device {device} is not a region")
        if backend == "UCX":
            _check_ucx_rkey(raw[_DESC.size:], reader)
        descriptors.append(Descriptor(address, length, device, raw[_DESC.size:]))
    return MemorySection(backend, _MEM_KINDS[kind], tuple(descriptors))


def _check_ucx_rkey(key: bytes, reader: _Reader) -> None:
    """``key`` is framed as UCP packs a remote key (``_RKEY_HEAD``): every field inside it,
    nothing after it, a known memory type."""
    if len(key) < _RKEY_HEAD.size:
        raise reader.error(f"a UCX remote key of {len(key)} bytes (at least {_RKEY_HEAD.size})")
    md_map, memory_type = _RKEY_HEAD.unpack_from(key)
    if memory_type >= _UCS_MEMORY_TYPES:
        raise reader.error(f"a UCX remote key of memory type {memory_type} (UCX knows 0 to "
                           f"{_UCS_MEMORY_TYPES - 1})")
    at = _RKEY_HEAD.size
    for _ in range(md_map.bit_count()):  # each MD's key: u8 size, then its bytes
        at += 1 + (key[at] if at < len(key) else 0)
    if md_map and at < len(key):
        at += 1
        if key[at - 1] != _SYS_DEVICE_UNKNOWN:  # distances, then the terminator
            while at < len(key) and key[at] != _SYS_DEVICE_UNKNOWN:
                at += _DISTANCE_BYTES
            at += 1
    elif md_map:
        at += 1  # the system device is missing: UCX would read past the key
    if at != len(key):
        raise reader.error(f"a UCX remote key of {len(key)} bytes whose fields take {at} "
                           f"(MD map {md_map:#x})")


def _record(tag: bytes, value: bytes) -> bytes:
    return tag + _U64.pack(len(value)) + value + b"|"


def encode_nixl_metadata(metadata: NixlMetadata) -> bytes:
    """The blob NIXL's ``get_agent_metadata`` would lay out for ``metadata`` (the inverse of
    ``parse_nixl_metadata``: ``encode(parse(blob)) == blob``). The name is not checked: the
    engine loads blobs under names of its own (``NixlTransport``)."""
    kinds = {kind: code for code, kind in _MEM_KINDS.items()}
    parts = [HEADER, _record(b"Agent", metadata.agent_name.encode("ascii")),
             _record(b"Conns", _U64.pack(len(metadata.connections)))]
    for backend, connection in metadata.connections:
        parts += [_record(b"t", backend.encode("ascii")), _record(b"c", connection)]
    parts += [_record(b"", _MEM_SECTION),
              _record(b"nixlSecElms", _U64.pack(len(metadata.sections)))]
    for section in metadata.sections:
        parts += [_record(b"bknd", section.backend.encode("ascii")), _record(*_DLIST),
                  _record(b"t", _U32.pack(kinds[section.kind])),
                  _record(b"n", _U64.pack(len(section.descriptors)))]
        parts += [_record(b"", _DESC.pack(d.address, d.length, d.device) + d.backend_key)
                  for d in section.descriptors]
    return b"".join(parts)


def check_reload(known: NixlMetadata, new: NixlMetadata) -> None:
    """A known agent's new metadata may only add or drop regions: its connection blob and the
    remote key of every region it listed before must be unchanged (docs/failure-modes.md #26).
    """
    name = new.agent_name
    if new.connections != known.connections:
        raise TransportError(
            f"peer {name!r} sent metadata whose connection info differs from the one loaded for "
            f"it: an agent's worker address never changes (a restarted process has a new agent "
            f"name); refused before NIXL loads it")
    before = known.backend_keys()
    for region, key in new.backend_keys().items():
        if region in before and before[region] != key:
            raise TransportError(
                f"peer {name!r} sent metadata whose remote key for its region at "
                f"{region[2]:#x} (+{region[3]}) differs from the loaded one although the region "
                f"did not change; refused before NIXL loads it")


def unseen_parts(known: NixlMetadata | None, new: NixlMetadata) -> NixlMetadata | None:
    """What of ``new`` UCX has not seen from this agent: all of it for an agent not loaded
    (``known`` None); for a reload (``check_reload`` passed) its connections and only the
    regions ``known`` did not list; None when a reload adds no region."""
    if known is None:
        return new
    before = known.backend_keys()
    sections = []
    for section in new.sections:
        fresh = tuple(d for d in section.descriptors
                      if (section.backend, section.kind, d.address, d.length, d.device)
                      not in before)
        if fresh:
            sections.append(MemorySection(section.backend, section.kind, fresh))
    return replace(new, sections=tuple(sections)) if sections else None
