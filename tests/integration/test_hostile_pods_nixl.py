"""Hostile pods, third round (docs/failure-modes.md #59, #60): a prefill and a decode rank as
processes with real NIXL between them (``SelftestGroup``, whose authority gives each pod an
identity), attacked from the test process by a pod INSIDE the deployment: it holds the
transfer key and a credential of its own (``mallory``), or it took the decode pod and reads
that pod's identity file.

- a pod claiming another instance's name in its document is refused at fetch; under its own
  name, its RequestKV for another decode's room is refused (``unbound_peer``) and answered
  with an Abort, and the request completes into the real decode, bit-exact;
- a second agent of the decode pod asking for coordinates that have a stream is refused
  (``duplicate_coords``);
- a ring announcement or a RequestKV under the decode rank's name from any other pod fails
  to authenticate: no ring moves, no ticket window moves, 5,000 forged early RequestKVs fail
  no legitimate request; the decode pod's own far-ahead ticket is refused (``ticket_leap``);
- a copy of a rank's document served from another port of its host is refused.

Each of these reached the victim's KV, moved its ring, or cut it off under protocol v6, where
the one deployment key was all a pod proved.
"""

from __future__ import annotations

import base64
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any

import pytest

from pd_contract.identity import IdentityFile, PodIdentity, verify_credential
from pd_transfer.protocol.messages import (
    PROTOCOL_VERSION,
    Message,
    RequestKV,
    RingUpdate,
    decode_message,
    encode_message,
)
from pd_transfer.reference.selftest import RequestSpec, SelftestConfig, SelftestGroup
from pd_transfer.transport.nixl import NixlTransport
from pd_transfer.trust.auth import Purpose
from pd_transfer.trust.bootstrap import (
    BootstrapServer,
    RankDocument,
    bound_agent_name,
    fetch_document,
)

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

CONFIG = SelftestConfig(prefill_tp=1, decode_tp=1, layers=2, kv_heads=2, head_dim=16,
                        page_size=16, tokens=64, requests=2, concurrency=2, mode="staged",
                        decode_pool_mib=4, prefill_buffer_mib=4, timeout_s=10.0)
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


class Pod:
    """A pod of the deployment run by the attacker: a NIXL agent named ``<base>@127.0.0.1``
    and the identity it speaks with (its own, or one it stole), publishing ``document``'s
    copy under its own name and transport metadata."""

    def __init__(self, group: SelftestGroup, identity: PodIdentity, instance: str,
                 like: RankDocument) -> None:
        self.group = group
        self.identity = identity
        self.transport = NixlTransport(bound_agent_name(f"pod-{uuid.uuid4().hex[:8]}",
                                                        "127.0.0.1"))
        self.name = self.transport.agent_name
        self.auth = group.auth.holding(identity)  # the transfer key, and this identity
        self.document = like.model_copy(update={
            "instance": instance, "agent_name": self.name, "credential": identity.wire,
            "transport_metadata_b64": base64.b64encode(self.transport.local_metadata()).decode(),
        })
        self.server = BootstrapServer(lambda: self.document, self.auth, "127.0.0.1",
                                      signer=identity)

    def publish_to(self, role: str) -> Any:
        """The ``role`` rank adds this pod as a peer: its answer (names, or an error)."""
        (answer,) = self.group.broadcast(role, "peers", [self.server.address])
        return answer

    def seal(self, target: RankDocument, message: Message, *, sender: str | None = None) -> bytes:
        return seal_for(self.group, self.identity, target, message, sender=sender or self.name)

    def received(self, target: RankDocument, at_least: int = 0,
                 wait_s: float = 5.0) -> list[Message]:
        """What ``target`` sent this pod within ``wait_s`` (sooner once ``at_least`` came),
        opened with their pair key."""
        assert target.credential is not None
        framer = self.group.auth.pair(self.identity, verify_credential(
            target.credential, self.group.auth.authorities))
        messages: list[Message] = []
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (not at_least or len(messages) < at_least):
            messages += [decode_message(framer.open(
                frame, purpose=Purpose.MESSAGE, version=PROTOCOL_VERSION, sender=peer,
                receiver=self.name)) for peer, frame in self.transport.poll_messages()]
            time.sleep(0.01)
        return messages

    def close(self) -> None:
        self.server.close()
        self.transport.close()


def seal_for(group: SelftestGroup, identity: PodIdentity, target: RankDocument,
             message: Message, *, sender: str) -> bytes:
    """``message`` as the pod of ``identity`` seals it for ``target`` (their pair's key)."""
    assert target.credential is not None
    framer = group.auth.pair(identity, verify_credential(target.credential,
                                                         group.auth.authorities))
    return framer.seal(encode_message(message), purpose=Purpose.MESSAGE,
                       version=PROTOCOL_VERSION, sender=sender, receiver=target.agent_name,
                       confidential=isinstance(message, RingUpdate))


def _send(agent: str, target: RankDocument, frames: list[bytes]) -> None:
    """``frames`` from a NIXL agent named ``agent`` to ``target``, delivered."""
    transport = NixlTransport(agent)
    try:
        transport.add_peer(target.transport_metadata, expected_name=target.agent_name)
        for frame in frames:
            transport.send_message(target.agent_name, frame)
        deadline = time.monotonic() + 1.0 + len(frames) / 5000
        while time.monotonic() < deadline:
            transport.poll_messages()
            time.sleep(0.01)
    finally:
        transport.close()


def _rejected(group: SelftestGroup, role: str) -> dict[str, int]:
    (stats,) = group.broadcast(role, "stats")
    return dict(stats["rejected"])


def _grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def _wait(group: SelftestGroup, room: str) -> list[dict[str, Any]]:
    results = []
    for role in ("decode", "prefill"):
        for rank_results in group.broadcast(role, "wait", [room], CONFIG.timeout_s * 2,
                                            timeout_s=CONFIG.timeout_s * 3):
            results.extend(dict(r, role=role) for r in rank_results)
    return results


def _exact(results: list[dict[str, Any]]) -> bool:
    return {(r["role"], r["state"]) for r in results} == {
        ("decode", "Succeeded"), ("prefill", "Succeeded")} and all(
        r["verified"] for r in results if r["role"] == "decode")


def _request_kv(spec: RequestSpec, ticket: int) -> RequestKV:
    return RequestKV(room=spec.room, ticket=ticket, decode_pp_rank=0, decode_tp_rank=0,
                     dst_page_runs=((min(spec.dst_pages), len(spec.dst_pages)),),
                     num_tokens=spec.num_tokens, path="contiguous", ring_version=0)


def _stolen(group: SelftestGroup, role: str) -> PodIdentity:
    (text,) = group.broadcast(role, "identity")
    return PodIdentity(IdentityFile.model_validate_json(text))


def test_a_pod_reads_no_other_instances_kv(group: SelftestGroup) -> None:
    """Attack 1. Mallory, a pod with a credential of its own, publishes a document claiming
    decode instance ``decode-0``: refused at fetch, naming its credential. Under its own name
    (accepted as a peer), it asks prefill for a live request of ``decode-0`` the moment
    prefill registers it: refused as ``unbound_peer``, answered with an Abort of its ticket,
    and no part of the KV reaches it; the request completes into the real decode."""
    prefill, decode = _document(group, PREFILL), _document(group, DECODE)
    mallory = group.auth.as_pod("decode", "mallory").pod_identity("decode", "mallory")
    assert mallory is not None
    claiming = Pod(group, mallory, "decode-0", decode)
    own = Pod(group, mallory, "mallory", decode)
    try:
        refused = claiming.publish_to("prefill")
        assert refused[0] == "error" and "claims decode instance 'decode-0', but its " \
            "credential is decode instance 'mallory'" in refused[1]
        assert own.publish_to("prefill") == [own.name]
        (spec,) = group.make_requests(1, mode="contiguous")
        before = _rejected(group, "prefill")
        group.broadcast("prefill", "register", [spec])
        _send(own.name, prefill, [own.seal(prefill, _request_kv(spec, ticket=1))])
        assert _grown(before, _rejected(group, "prefill")) == {"unbound_peer": 1}
        answers = own.received(prefill, at_least=1)
        assert [(m.type, getattr(m, "ticket", None)) for m in answers] == [("abort", 1)]
        group.broadcast("decode", "register", [spec])
        group.broadcast("prefill", "send", [spec.room])
        assert _exact(_wait(group, spec.room))
        assert own.received(prefill, wait_s=1.0) == []  # no WRITE notification: nothing
    finally:
        claiming.close()
        own.close()


def test_a_second_agent_of_the_decode_pod_gets_no_second_stream(group: SelftestGroup) -> None:
    """The decode pod itself, compromised, starts a second agent for rank (0, 0) of its own
    instance and asks for a request its real rank asked for already: refused as
    ``duplicate_coords``; the request completes once, into the real rank's pages."""
    prefill, decode = _document(group, PREFILL), _document(group, DECODE)
    twin = Pod(group, _stolen(group, "decode"), "decode-0", decode)
    try:
        assert twin.publish_to("prefill") == [twin.name]
        (spec,) = group.make_requests(1, mode="contiguous")
        group.broadcast("decode", "register", [spec])  # its RequestKV waits on prefill
        group.broadcast("prefill", "register", [spec])  # now the real stream opens
        before = _rejected(group, "prefill")
        _send(twin.name, prefill, [twin.seal(prefill, _request_kv(spec, ticket=1))])
        assert _grown(before, _rejected(group, "prefill")) == {"duplicate_coords": 1}
        group.broadcast("prefill", "send", [spec.room])
        assert _exact(_wait(group, spec.room))
    finally:
        twin.close()


def test_no_other_pod_can_speak_as_the_decode_rank(group: SelftestGroup) -> None:
    """Attacks 2 and 3. Under the decode rank's agent name, Mallory announces a ring inside
    the rank's KV pool, sends a RequestKV with ticket 2^63-1 and 5,000 early RequestKVs with
    the tickets decode will use next: every one fails to authenticate (the pair key is the
    decode pod's and prefill's), no ring or ticket window moves, and requests afterwards,
    staged and contiguous, complete bit-exactly."""
    prefill, decode = _document(group, PREFILL), _document(group, DECODE)
    assert decode.ring is not None
    mallory = group.auth.as_pod("decode", "mallory").pod_identity("decode", "mallory")
    assert mallory is not None
    pod = Pod(group, mallory, "mallory", decode)
    try:
        ring = RingUpdate(ring_version=decode.ring_version + 1, name=f"{decode.agent_name}/x",
                          base_address=decode.kv_regions[0].base_address,
                          size_bytes=decode.ring.size_bytes, kind=decode.ring.kind,
                          device_id=decode.ring.device_id,
                          transport_metadata_b64=decode.transport_metadata_b64)
        (probe,) = group.make_requests(1, mode="staged")  # its room and pages, never run
        forged: list[Message] = [ring, _request_kv(probe, 2**63 - 1)]
        forged += [_request_kv(replace(probe, room=f"squat{i}"), ticket=1000 + i)
                   for i in range(5000)]
        before = _rejected(group, "prefill")
        (rings,) = group.broadcast("prefill", "peer_rings")
        _send(decode.agent_name, prefill,
              [pod.seal(prefill, m, sender=decode.agent_name) for m in forged])
        assert _grown(before, _rejected(group, "prefill")) == {"unauthenticated": 5002}
        assert group.broadcast("prefill", "peer_rings") == [rings]
        for mode in ("staged", "contiguous"):
            _, results = group.run_wave(group.make_requests(2, mode=mode))  # type: ignore[arg-type]
            assert {(r["role"], r["state"]) for r in results} == {("decode", "Succeeded"),
                                                                  ("prefill", "Succeeded")}
            assert [r["verified"] for r in results if r["role"] == "decode"] == [True, True]
    finally:
        pod.close()


def test_the_decode_pods_own_far_ahead_ticket_moves_no_window(group: SelftestGroup) -> None:
    """A compromised decode pod's own RequestKV with ticket 2^63-1 (which it can seal) is
    refused as ``ticket_leap`` with an Abort: its window stays where its requests are, so its
    next real requests are not ``stale_ticket``."""
    prefill, decode = _document(group, PREFILL), _document(group, DECODE)
    stolen = _stolen(group, "decode")
    (spec,) = group.make_requests(1, mode="contiguous")
    before = _rejected(group, "prefill")
    _send(decode.agent_name, prefill, [seal_for(group, stolen, prefill,
                                                _request_kv(spec, 2**63 - 1),
                                                sender=decode.agent_name)])
    assert _grown(before, _rejected(group, "prefill")) == {"ticket_leap": 1}
    _, results = group.run_wave(group.make_requests(2, mode="contiguous"))
    assert [r["verified"] for r in results if r["role"] == "decode"] == [True, True]


def test_a_copy_of_a_document_from_another_port_is_refused(group: SelftestGroup) -> None:
    """Attack 5. A process on the decode pod's address, another port, serves the decode
    rank's own sealed, signed document byte for byte: refused, since the document names the
    port it was rendered for."""
    address = group.addresses[DECODE]
    with urllib.request.urlopen(f"http://{address}/v1/rank", timeout=10) as response:
        sealed = response.read()

    class Copy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(sealed)))
            self.end_headers()
            self.wfile.write(sealed)

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Copy)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        (answer,) = group.broadcast("prefill", "peers", [f"127.0.0.1:{port}"])
        assert answer[0] == "error"
        assert (f"the document was rendered for port {address.rpartition(':')[2]}, but port "
                f"{port} served it") in answer[1]
    finally:
        server.shutdown()
        server.server_close()
