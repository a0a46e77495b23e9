"""Hostile peers, second round (docs/failure-modes.md #26, #47, #48): a prefill and a decode
rank as processes with real NIXL between them (``SelftestGroup``), attacked from the test
process the way a key holder or an eavesdropper can:

- frames of a finished request, captured off the fabric (the ranks' ``tap_frames``) and
  replayed byte for byte from a NIXL agent named as their sender, into a new request that
  reuses the room id: refused as another incarnation's (``stale_ticket`` / ``replayed``), and
  the new request completes bit-exactly from the real peer;
- ring announcements that move a decode rank's ring into its KV pool, repeat its version with
  another region, or carry a version of thousands of digits: refused, and staged requests
  afterwards land bit-exactly;
- a bootstrap document served from one host that names an agent bound to another: refused;
- a process without the key that GETs a rank's document: it learns no address, no remote key.

Each of these ended a request ``Succeeded`` with wrong KV, or gave a keyless process the remote
keys, before request incarnations, ring checks, name binding and encrypted documents.
"""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from pd_contract.identity import IdentityFile, PodIdentity, verify_credential
from pd_transfer.protocol.messages import (
    PROTOCOL_VERSION,
    Message,
    RingUpdate,
    decode_message,
    encode_message,
)
from pd_transfer.reference.selftest import RequestSpec, SelftestConfig, SelftestGroup
from pd_transfer.transport.nixl import NixlTransport
from pd_transfer.trust.auth import SECRET_MAGIC, PeerAuth, Purpose, outgoing_body
from pd_transfer.trust.bootstrap import (
    DOCUMENT_VERSION,
    BootstrapServer,
    RankDocument,
    bound_agent_name,
    fetch_document,
)

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

CONFIG = SelftestConfig(prefill_tp=1, decode_tp=1, layers=2, kv_heads=2, head_dim=16,
                        page_size=16, tokens=64, requests=2, concurrency=2, mode="staged",
                        decode_pool_mib=4, prefill_buffer_mib=4, timeout_s=10.0,
                        tap_frames=256)
PREFILL, DECODE = ("prefill", 0, 0), ("decode", 0, 0)


@pytest.fixture(scope="module")
def group() -> Iterator[SelftestGroup]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    group = SelftestGroup(CONFIG)
    try:
        yield group
    finally:
        group.close()


def _document(group: SelftestGroup, key: tuple[str, int, int]) -> RankDocument:
    return fetch_document(group.addresses[key], 30.0, group.auth)


def stolen_identity(group: SelftestGroup, role: str) -> PodIdentity:
    """The identity file of the ``role`` rank's pod, as an attacker who took that pod reads
    it (the selftest's ``identity`` command)."""
    (text,) = group.broadcast(role, "identity")
    return PodIdentity(IdentityFile.model_validate_json(text))


def seal_from(group: SelftestGroup, identity: PodIdentity, sender: str, target: RankDocument,
              message: Message | bytes, *, confidential: bool = False) -> bytes:
    """``message`` sealed by the pod of ``identity`` as agent ``sender`` for ``target``, with
    the key of their pair (what that pod, and only it, can seal)."""
    assert target.credential is not None
    framer = group.auth.pair(identity, verify_credential(target.credential,
                                                         group.auth.authorities))
    body = message if isinstance(message, bytes) else encode_message(message)
    return framer.seal(body, purpose=Purpose.MESSAGE, version=PROTOCOL_VERSION, sender=sender,
                       receiver=target.agent_name,
                       confidential=confidential or isinstance(message, RingUpdate))


class Impostor:
    """A NIXL agent in the test process named as ``name`` (a rank of the group), connected to
    ``target``: what it sends reaches the target as coming from ``name``."""

    def __init__(self, name: str, target: RankDocument) -> None:
        self.transport = NixlTransport(name)
        self.target = target.agent_name
        self.transport.add_peer(target.transport_metadata, expected_name=target.agent_name)

    def send(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.transport.send_message(self.target, frame)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # no progress thread: progress until delivered
            self.transport.poll_messages()
            time.sleep(0.01)

    def close(self) -> None:
        self.transport.close()


def _taken(group: SelftestGroup, role: str, sender: str, room: str) -> list[tuple[Message, bytes]]:
    """The frames ``sender`` sent a ``role`` rank about ``room`` (off the tap), decoded from
    their MACed (readable) bodies."""
    (frames,) = group.broadcast(role, "frames")
    taken = []
    for name, frame in frames:
        body = outgoing_body(frame)
        if name != sender or body is None:
            continue
        message = decode_message(body)
        if getattr(message, "room", None) == room:
            taken.append((message, frame))
    return taken


def _rejected(group: SelftestGroup, role: str) -> dict[str, int]:
    (stats,) = group.broadcast(role, "stats")
    return dict(stats["rejected"])


def _states(group: SelftestGroup, role: str, room: str) -> Any:
    (states,) = group.broadcast(role, "states", [room])
    return states[room]


def _again(group: SelftestGroup, spec: RequestSpec) -> RequestSpec:
    """A new request with ``spec``'s room id: other pages on both sides, other KV."""
    (fresh,) = group.make_requests(1, mode=spec.mode)
    return replace(fresh, room=spec.room)


def _finish(group: SelftestGroup, spec: RequestSpec) -> list[dict[str, Any]]:
    """Prefill registers and sends ``spec`` (decode registered it already); both results."""
    group.broadcast("prefill", "register", [spec])
    group.broadcast("prefill", "send", [spec.room])
    results = []
    for role in ("decode", "prefill"):
        for rank_results in group.broadcast(role, "wait", [spec.room], CONFIG.timeout_s * 2,
                                            timeout_s=CONFIG.timeout_s * 3):
            results.extend(dict(r, role=role) for r in rank_results)
    return results


def _succeeded_exactly(results: list[dict[str, Any]]) -> bool:
    return {(r["role"], r["state"]) for r in results} == {
        ("decode", "Succeeded"), ("prefill", "Succeeded")} and all(
        r["verified"] for r in results if r["role"] == "decode")


@pytest.mark.parametrize("mode", ["staged", "contiguous"])
def test_replayed_frames_never_complete_a_request_that_reuses_the_room(
        group: SelftestGroup, mode: str) -> None:
    """Room R finished; a new request reuses the id R. R's old notifications (staged: its
    AllocRequest and StagedPart; contiguous: its PartDone), replayed byte for byte before
    prefill sends anything, used to end the new R ``Succeeded`` on decode with its pages
    unwritten. They are another incarnation's now: refused, counted, and the new R completes
    from the real prefill."""
    prefill, decode = _document(group, PREFILL), _document(group, DECODE)
    (spec,) = group.make_requests(1, mode=mode)  # type: ignore[arg-type]
    _, results = group.run_wave([spec])
    assert _succeeded_exactly(results)
    captured = _taken(group, "decode", prefill.agent_name, spec.room)
    kinds = sorted({m.type for m, _ in captured})
    assert kinds == (["alloc_request", "staged_part"] if mode == "staged" else ["part_done"])
    before = _rejected(group, "decode")

    reused = _again(group, spec)
    group.broadcast("decode", "register", [reused])
    impostor = Impostor(prefill.agent_name, decode)
    try:
        impostor.send([frame for _, frame in captured])
    finally:
        impostor.close()
    assert _states(group, "decode", reused.room) == "Transferring"
    after = _rejected(group, "decode")
    assert after.get("stale_ticket", 0) - before.get("stale_ticket", 0) == len(captured)
    assert _succeeded_exactly(_finish(group, reused))


def test_a_replayed_request_kv_never_makes_prefill_write_into_a_finished_requests_pages(
        group: SelftestGroup) -> None:
    """Decode's RequestKV of a finished request R, replayed to prefill once a new request
    reuses the id R there, used to be taken as the new R's: prefill wrote its KV into the
    pages decode had given the OLD R (which may hold another request's KV by now). It is a
    replay: refused before any WRITE, and the new R completes into its own pages."""
    prefill, decode = _document(group, PREFILL), _document(group, DECODE)
    (spec,) = group.make_requests(1, mode="contiguous")
    _, results = group.run_wave([spec])
    assert _succeeded_exactly(results)
    captured = [(m, f) for m, f in _taken(group, "prefill", decode.agent_name, spec.room)
                if m.type == "request_kv"]
    assert len(captured) == 1
    reused = _again(group, spec)
    (stats,) = group.broadcast("prefill", "stats")
    group.broadcast("prefill", "register", [reused])
    group.broadcast("prefill", "send", [reused.room])
    impostor = Impostor(decode.agent_name, prefill)
    try:
        impostor.send([captured[0][1]])
    finally:
        impostor.close()
    (after,) = group.broadcast("prefill", "stats")
    assert after["writes_posted"] == stats["writes_posted"]  # nothing written for it
    assert after["rejected"].get("replayed", 0) - stats["rejected"].get("replayed", 0) == 1
    assert _states(group, "prefill", reused.room) == "Bootstrapping"
    group.broadcast("decode", "register", [reused])
    results = []
    for role in ("decode", "prefill"):
        for rank_results in group.broadcast(role, "wait", [reused.room], CONFIG.timeout_s * 2,
                                            timeout_s=CONFIG.timeout_s * 3):
            results.extend(dict(r, role=role) for r in rank_results)
    assert _succeeded_exactly(results)


def _ring_update(decode: RankDocument, version: int, base: int, size: int) -> RingUpdate:
    assert decode.ring is not None
    return RingUpdate(ring_version=version, name=f"{decode.agent_name}/moved",
                      base_address=base, size_bytes=size, kind=decode.ring.kind,
                      device_id=decode.ring.device_id,
                      transport_metadata_b64=decode.transport_metadata_b64)


def test_a_ring_announcement_cannot_move_a_decode_ring_into_its_kv_pool(
        group: SelftestGroup) -> None:
    """The decode rank's own pod, compromised (it seals with its own pair key), announcing a
    newer ring inside the rank's KV pool (with the rank's own, unchanged metadata) used to be
    taken: prefill then wrote staged
    parts into KV pages of other requests while decode scattered from its real ring. A
    conflicting announcement of the version in force, a version 4001 digits long and one far
    ahead are refused too; staged requests afterwards land bit-exactly."""
    prefill, decode = _document(group, PREFILL), _document(group, DECODE)
    assert decode.ring is not None
    pool = decode.kv_regions[0]
    version = decode.ring_version
    forged = [
        _ring_update(decode, version + 1, pool.base_address, decode.ring.size_bytes),
        _ring_update(decode, version + 1, pool.base_address + 4096, 4096),
        _ring_update(decode, version, decode.ring.base_address + 64, 4096),  # same version
        _ring_update(decode, version + 10_000, decode.ring.base_address,
                     decode.ring.size_bytes),
    ]
    huge = json.loads(forged[0].model_dump_json())
    huge["ring_version"] = int("9" * 4001)
    huge_body = json.dumps(huge).encode()
    before = _rejected(group, "prefill")
    victim = stolen_identity(group, "decode")
    frames = [seal_from(group, victim, decode.agent_name, prefill, m) for m in forged]
    frames.append(seal_from(group, victim, decode.agent_name, prefill, huge_body,
                            confidential=True))
    impostor = Impostor(decode.agent_name, prefill)
    try:
        impostor.send(frames)
    finally:
        impostor.close()
    after = _rejected(group, "prefill")
    grown = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in grown.items() if v} == {
        "invalid_ring_update": 3, "conflicting_registration": 1, "invalid_body": 1}
    _, results = group.run_wave(group.make_requests(2, mode="staged"))
    assert {(r["role"], r["state"]) for r in results} == {("decode", "Succeeded"),
                                                          ("prefill", "Succeeded")}
    assert [r["verified"] for r in results if r["role"] == "decode"] == [True, True]


def test_a_document_cannot_name_an_agent_bound_to_another_pod(group: SelftestGroup) -> None:
    """A key holder serving, from its own address, a document that names a decode rank's
    agent used to win that name at every prefill that fetched it first (and so receive that
    rank's WRITEs). Names are bound to the host that serves them: refused, naming both; a
    document naming the server's own host is a peer like any other. The attacker here is a
    pod of the deployment with an identity of its own, signing what it serves."""
    decode = _document(group, DECODE)
    mallory = group.auth.as_pod("decode", "mallory")
    signer = mallory.pod_identity("decode", "mallory")
    assert signer is not None
    victim_name = bound_agent_name(f"decode-0-0-{uuid.uuid4().hex[:8]}", "127.0.0.1")
    impostor = NixlTransport(victim_name)
    own = NixlTransport(bound_agent_name(f"mallory-{uuid.uuid4().hex[:8]}", "127.0.0.66"))
    mine = {"instance": "mallory", "credential": signer.wire}
    claims = {
        "borrowed": decode.model_copy(update={
            **mine, "agent_name": victim_name,
            "transport_metadata_b64": base64.b64encode(impostor.local_metadata()).decode()}),
        "own": decode.model_copy(update={
            **mine, "agent_name": own.agent_name,
            "transport_metadata_b64": base64.b64encode(own.local_metadata()).decode()}),
    }
    servers = {label: BootstrapServer(lambda d=doc: d, mallory, "127.0.0.66", signer=signer)
               for label, doc in claims.items()}
    try:
        (borrowed,) = group.broadcast("prefill", "peers", [servers["borrowed"].address])
        assert borrowed[0] == "error"
        assert (f"names agent {victim_name!r}, bound to host '127.0.0.1', but '127.0.0.66' "
                f"served it") in borrowed[1]
        (accepted,) = group.broadcast("prefill", "peers", [servers["own"].address])
        assert accepted == [own.agent_name]
    finally:
        for server in servers.values():
            server.close()
        impostor.close()
        own.close()
    _, results = group.run_wave(group.make_requests(2))
    assert [r["verified"] for r in results if r["role"] == "decode"] == [True, True]


def test_a_process_without_the_key_learns_no_transport_secret(group: SelftestGroup) -> None:
    """Anyone who could GET a rank's document used to read its worker address, region
    addresses and remote keys, and could then WRITE into its ring without the key. The
    document travels encrypted: none of it appears in what a keyless GET returns."""
    for key in (PREFILL, DECODE):
        with urllib.request.urlopen(f"http://{group.addresses[key]}/v1/rank",
                                    timeout=10) as response:
            raw = response.read()
        document = _document(group, key)
        assert raw.startswith(SECRET_MAGIC) and document.v == DOCUMENT_VERSION
        metadata = document.transport_metadata
        secrets = [document.agent_name.encode(), document.transport_metadata_b64[:24].encode()]
        secrets += [metadata[at:at + 16] for at in range(0, len(metadata) - 16, 16)]
        secrets += [str(r.base_address).encode() for r in document.kv_regions]
        assert [s for s in secrets if s in raw] == []
        with pytest.raises(ValueError):
            json.loads(raw[len(SECRET_MAGIC):])
        with pytest.raises(Exception, match="no accepted key decrypts it"):
            PeerAuth.generate().open(raw, purpose=Purpose.DOCUMENT, version=DOCUMENT_VERSION,
                                     sender="", receiver="", confidential=True)
