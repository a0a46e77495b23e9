"""What of a peer's NIXL metadata the engine loads, and under which name (transport/
nixl_admission.py, nixl_metadata.py, the verdicts of nixl_vetter.py): pure bookkeeping,
no NIXL. The vetting process itself runs NIXL: tests/integration/test_nixl_metadata_vetting.py.
"""

from __future__ import annotations

import struct
from dataclasses import replace

import pydantic
import pytest

from pd_transfer.errors import TransportError
from pd_transfer.transport import nixl_admission
from pd_transfer.transport.nixl_admission import (
    MAX_REFUSED_LOADS,
    MAX_SOURCE_DEATHS,
    PeerAdmission,
)
from pd_transfer.transport.nixl_metadata import (
    encode_nixl_metadata,
    parse_nixl_metadata,
    unseen_parts,
)
from pd_transfer.transport.nixl_vetter import (
    MetadataVetter,
    Verdict,
    VetOutcome,
    VetterSpec,
    VettingStats,
)

NAME = "decode-1"


def _record(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value + b"|"


def _key(transport_key: bytes, memory_type: int = 0, device: bytes = b"\xff") -> bytes:
    """A UCX remote key as UCP packs it: MD map 1 (one transport key), then the device."""
    return struct.pack("<QBB", 1, memory_type, len(transport_key)) + transport_key + device


def _section(kind: int, regions: list[tuple[int, int, bytes]]) -> bytes:
    blob = _record(b"bknd", b"UCX") + _record(b"nixlDList", b"nixlSDList")
    blob += _record(b"t", struct.pack("<I", kind)) + _record(b"n", struct.pack("<Q", len(regions)))
    for address, length, key in regions:
        blob += _record(b"", struct.pack("<QQQ", address, length, kind) + key)
    return blob


def _blob(*sections: bytes, conn: bytes = b"\x02ucx-address", name: bytes = NAME.encode()) -> bytes:
    """A blob laid out as nixl 1.5.1's ``get_agent_metadata`` lays it out, by hand."""
    blob = b"nixlSerDes|" + _record(b"Agent", name) + _record(b"Conns", struct.pack("<Q", 1))
    blob += _record(b"t", b"UCX") + _record(b"c", conn) + _record(b"", b"MemSection")
    return blob + _record(b"nixlSecElms", struct.pack("<Q", len(sections))) + b"".join(sections)


ONE = _section(0, [(0x1000, 4096, _key(b"a"))])
TWO = _section(0, [(0x1000, 4096, _key(b"a")), (0x9000, 8192, _key(b"b"))])
VRAM = _section(1, [(0x7F0000, 65536, _key(b"v", 1))])


@pytest.mark.parametrize("blob", [_blob(), _blob(ONE), _blob(TWO, VRAM)])
def test_encoding_a_parsed_blob_gives_it_back_byte_for_byte(blob: bytes) -> None:
    assert encode_nixl_metadata(parse_nixl_metadata(blob, NAME)) == blob


def test_a_memory_section_without_descriptors_is_refused_before_nixl() -> None:
    """NIXL refuses such a section after loading the connection, which poisons the agent's
    name (nixl 1.5.1): it never gets that far."""
    with pytest.raises(TransportError, match="memory section of backend 'UCX' lists no desc"):
        parse_nixl_metadata(_blob(_section(0, [])), NAME)


@pytest.mark.parametrize("key", [
    struct.pack("<QB", 0, 0),  # no MD: no device byte either
    _key(b"", device=b"\x03" + b"\x03\x10\x20" + b"\x07\xff\xff" + b"\xff"),  # distances
    struct.pack("<QB", 0b101, 9) + b"\x02ab" + b"\x00" + b"\xff",  # two MDs, memory type 9
])
def test_ucx_remote_keys_framed_as_ucp_packs_them_pass(key: bytes) -> None:
    parse_nixl_metadata(_blob(_section(0, [(0x1000, 4096, key)])), NAME)


@pytest.mark.parametrize(("key", "message"), [
    (_key(b"", memory_type=0x80), "memory type 128 \\(UCX knows 0 to 9\\)"),
    (_key(b"", memory_type=10), "memory type 10"),
    (b"\x01" * 8, "a UCX remote key of 8 bytes \\(at least 9\\)"),
    (struct.pack("<QBB", 1, 0, 5) + b"ab", "of 12 bytes whose fields take 16"),  # size overrun
    (struct.pack("<QBB", 3, 0, 0), "of 10 bytes whose fields take 12"),  # 2 MDs, 1 key
    (struct.pack("<QBB", 1, 0, 0), "of 10 bytes whose fields take 11"),  # no device byte
    (_key(b"", device=b"\x03\x03\x10\x20"), "whose fields take 15"),  # no terminator
    (_key(b"", device=b"\x03\x03\x10\xff"), "whose fields take 15"),  # a distance cut short
    (_key(b"") + b"\x00", "of 12 bytes whose fields take 11"),  # bytes after the device
])
def test_ucx_remote_keys_ucx_would_misread_are_refused_before_nixl(key: bytes,
                                                                   message: str) -> None:
    """NIXL hands UCX a key without its length: UCX reads as far as the key's fields say, and
    indexes tables with its memory type (0x80: SIGSEGV, measured)."""
    with pytest.raises(TransportError, match=message):
        parse_nixl_metadata(_blob(_section(0, [(0x1000, 4096, key)])), NAME)


def test_only_what_ucx_has_not_seen_from_an_agent_is_vetted() -> None:
    one, two = parse_nixl_metadata(_blob(ONE), NAME), parse_nixl_metadata(_blob(TWO), NAME)
    assert unseen_parts(None, one) == one  # a new agent: all of it
    fresh = unseen_parts(one, two)  # a reload adding a region: its key, with the connection
    assert fresh is not None and fresh.connections == two.connections
    assert encode_nixl_metadata(fresh) == _blob(_section(0, [(0x9000, 8192, _key(b"b"))]))
    assert unseen_parts(two, one) is None  # dropping a region brings nothing new
    assert unseen_parts(two, two) is None


def test_a_peer_whose_load_nixl_refused_is_loaded_later_under_a_fresh_name() -> None:
    """NIXL 1.5.1 keeps UCX's endpoint under a refused agent's name: the next load of that
    peer goes to NIXL as "<peer> #<n>" (a name no peer can have), re-encoded, and so on up to
    MAX_REFUSED_LOADS refusals; then the peer is not loaded any more."""
    admission = PeerAdmission(None)
    blob = _blob(ONE)
    admitted = admission.admit(blob, NAME)
    assert (admitted.nixl_name, admitted.blob) == (NAME, blob)
    assert admission.refused(NAME) == NAME  # the name to remove from NIXL
    again = admission.admit(blob, NAME)
    assert again.nixl_name == f"{NAME} #1" and admission.nixl_name(NAME) == f"{NAME} #1"
    assert again.blob == encode_nixl_metadata(replace(again.metadata, agent_name=f"{NAME} #1"))
    with pytest.raises(TransportError, match="not printable ASCII without spaces"):
        parse_nixl_metadata(again.blob, f"{NAME} #1")  # no peer could send that name
    admission.loaded(NAME, again)
    assert admission.admit(_blob(TWO), NAME).nixl_name == f"{NAME} #1"  # a reload: same name
    for count in range(2, MAX_REFUSED_LOADS + 1):
        assert admission.refused(NAME) == f"{NAME} #{count - 1}"
    with pytest.raises(TransportError, match=f"refused {MAX_REFUSED_LOADS} loads of peer "
                                             f"'decode-1'.*restart that peer"):
        admission.admit(blob, NAME)
    assert admission.admit(_blob(ONE, name=b"decode-2"), "decode-2").nixl_name == "decode-2"


def test_a_reload_must_keep_the_connection_and_the_known_keys() -> None:
    admission = PeerAdmission(None)
    admission.loaded(NAME, admission.admit(_blob(ONE), NAME))
    with pytest.raises(TransportError, match="connection info differs"):
        admission.admit(_blob(ONE, conn=b"\x02other-address"), NAME)
    with pytest.raises(TransportError, match="remote key for its region at 0x1000"):
        admission.admit(_blob(_section(0, [(0x1000, 4096, _key(b"X"))])), NAME)
    admission.removed(NAME)  # a removed peer may come back with anything
    assert admission.admit(_blob(ONE, conn=b"\x02other-address"), NAME).nixl_name == NAME
    assert admission.vetting.starts == 0  # no vetting process without one


@pytest.mark.parametrize(("verdict", "message"), [
    (Verdict(outcome=VetOutcome.KILLED, detail="SIGABRT"),
     r"transport metadata of agent 'decode-1' killed a vetting process \(SIGABRT\); not "
     "loaded"),
    (Verdict(outcome=VetOutcome.STALLED, detail="no answer within 10 s; killed"),
     r"stalled a vetting process \(no answer within 10 s; killed\); not loaded \(raise "
     r"NixlConfig.vet_timeout_s"),
    (Verdict(outcome=VetOutcome.REFUSED, detail="NIXL_ERR_BACKEND"),
     r"was refused by NIXL in a vetting process \(NIXL_ERR_BACKEND\); not loaded"),
    (Verdict(outcome=VetOutcome.UNAVAILABLE, detail="no python"),
     r"could not be vetted: no python; not loaded \(fix .*vet_metadata=False"),
])
def test_a_verdict_other_than_loaded_says_why_the_blob_was_refused(verdict: Verdict,
                                                                   message: str) -> None:
    refusal = verdict.refusal(NAME)
    assert refusal is not None
    with pytest.raises(TransportError, match=message):
        raise refusal
    assert Verdict(outcome=VetOutcome.LOADED).refusal(NAME) is None


def test_a_vetting_process_answer_is_validated() -> None:
    verdict = Verdict(outcome=VetOutcome.REFUSED, detail="x")
    assert Verdict.model_validate_json(verdict.model_dump_json()) == verdict
    for bad in ('{"outcome": "fine"}', '{"outcome": "loaded", "extra": 1}', "[]"):
        with pytest.raises(pydantic.ValidationError):
            Verdict.model_validate_json(bad)


class _DyingVetter:
    """Stands in for a vetting process whose every blob kills it (the real one:
    tests/integration/test_nixl_metadata_vetting.py); here, to step past CONDEMNED_S."""

    def __init__(self) -> None:
        self.stats = VettingStats()

    def start(self) -> None:
        self.stats.starts += 1

    def vet(self, metadata: object) -> Verdict:
        self.stats.deaths += 1
        return Verdict(outcome=VetOutcome.KILLED, detail="SIGSEGV")


def test_a_host_whose_blobs_killed_three_vetters_is_refused_until_600_s_after_the_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(nixl_admission.time, "monotonic", lambda: now[0])
    vetter = _DyingVetter()
    admission = PeerAdmission(vetter)  # type: ignore[arg-type]
    for index in range(MAX_SOURCE_DEATHS):
        name = f"m{index}@10.0.0.9"
        with pytest.raises(TransportError, match=r"killed a vetting process \(SIGSEGV\)"):
            admission.admit(_blob(ONE, name=name.encode()), name)
        now[0] += 100.0
    refused = r"not loaded: blobs from 10.0.0.9 killed or stalled 3 vetting processes in the " \
              r"last 600 s; what its agents bring new is refused for 500 s more"
    with pytest.raises(TransportError, match=refused):
        admission.admit(_blob(ONE, name=b"m9@10.0.0.9"), "m9@10.0.0.9")
    assert vetter.stats.deaths == MAX_SOURCE_DEATHS  # refused without vetting
    with pytest.raises(TransportError, match=r"killed a vetting process"):  # another host
        admission.admit(_blob(ONE, name=b"d0@10.0.0.10"), "d0@10.0.0.10")
    now[0] += 400.0  # 600 s after the second death: only the third is still recent
    with pytest.raises(TransportError, match=r"killed a vetting process"):
        admission.admit(_blob(ONE, name=b"m9@10.0.0.9"), "m9@10.0.0.9")


def test_a_closed_vetter_refuses_without_starting_a_process() -> None:
    vetter = MetadataVetter(VetterSpec("closed", "nixl._api", ("UCX",), 0, ()))
    vetter.close()
    verdict = vetter.vet(parse_nixl_metadata(_blob(ONE), NAME))
    assert verdict == Verdict(outcome=VetOutcome.UNAVAILABLE, detail="the vetter is closed")
    assert vetter.stats == VettingStats()
