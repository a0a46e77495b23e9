"""Hostile peers against a real prefill process (NIXL over UCX on lo): mutated and misnamed
transport metadata from an unauthenticated peer and from an authenticated one never reach
NIXL's loader, the prefill process survives, and a legitimate request afterwards is
bit-exact (docs/failure-modes.md #26: only authenticated peers' metadata reaches NIXL,
bound to the name it claims).

The group's prefill and decode ranks are processes (``SelftestGroup``); the attackers live in
the test process: "mallory", a decode rank holding the deployment's key that the prefill
connected to, and "stranger", a NIXL agent without the key that loaded the prefill's public
metadata.
"""

from __future__ import annotations

import base64
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from pd_contract.identity import verify_credential
from pd_testbed.transfer_harness import seal_as
from pd_transfer.decode import DecodeReceiver
from pd_transfer.endpoint import RankIdentity
from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.plan import Parallelism, RankCoord
from pd_transfer.kv.pool import KVPool
from pd_transfer.protocol.messages import PROTOCOL_VERSION, RingUpdate, encode_message
from pd_transfer.reference.selftest import SelftestConfig, SelftestGroup
from pd_transfer.transport.base import RegisteredRegion
from pd_transfer.transport.nixl import NixlTransport
from pd_transfer.trust.auth import PeerAuth, Purpose
from pd_transfer.trust.bootstrap import (
    DTYPES,
    BootstrapServer,
    RankDocument,
    bound_agent_name,
    fetch_document,
)

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

CONFIG = SelftestConfig(prefill_tp=1, decode_tp=1, layers=2, kv_heads=2, head_dim=16,
                        page_size=16, tokens=64, requests=2, concurrency=2, mode="staged",
                        decode_pool_mib=4, prefill_buffer_mib=4, timeout_s=30.0)
PREFILL, DECODE = ("prefill", 0, 0), ("decode", 0, 0)
FUZZED = 300  # random 1-4 byte mutations of mallory's metadata, each in its own RingUpdate
SPARE_BYTES = 4096  # each RingUpdate announces a buffer mallory registered just before


class Mallory:
    """An authenticated decode rank (no worker: it only sends what the test tells it)."""

    def __init__(self, group: SelftestGroup) -> None:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        self.transport = NixlTransport(bound_agent_name(f"mallory-{uuid.uuid4().hex[:8]}",
                                                        "127.0.0.1"))
        geometry = fetch_document(group.addresses[DECODE], 30.0, group.auth).geometry
        layout = KVLayout(CONFIG.layers, 8, CONFIG.page_size, CONFIG.kv_heads, CONFIG.head_dim,
                          DTYPES[geometry.dtype])
        self.receiver = DecodeReceiver(
            self.transport, KVPool.allocate(layout),
            RankIdentity("mallory", RankCoord(0, 0), Parallelism(1), geometry),
            auth=group.auth, ring_bytes=1 << 20)
        self.server = BootstrapServer(self.receiver.document, group.auth,
                                      signer=self.receiver.pod_identity)
        self.prefill = fetch_document(group.addresses[PREFILL], 30.0, group.auth)
        self.transport.add_peer(self.prefill.transport_metadata,
                                expected_name=self.prefill.agent_name)
        self.group = group
        self.spares: list[torch.Tensor] = []
        self.spare: RegisteredRegion | None = None
        self.spare = self.register_spare()

    @property
    def name(self) -> str:
        return self.transport.agent_name

    def register_spare(self) -> RegisteredRegion:
        """A fresh buffer mallory registers in place of the last (what a real resize does): a
        RingUpdate naming it passes prefill's ring checks, so its metadata goes on to be
        parsed, vetted and loaded."""
        if self.spare is not None:
            self.transport.deregister(self.spare)
        self.spares.append(torch.empty(SPARE_BYTES, dtype=torch.uint8))
        return self.transport.register(self.spares[-1])

    def version_in_force(self) -> int:
        (rings,) = self.group.broadcast("prefill", "peer_rings")
        return int(rings[self.name])

    def ring_update(self, metadata: bytes, version: int | None = None) -> RingUpdate:
        """A RingUpdate announcing mallory's latest spare buffer, one version past the one
        prefill holds (or ``version``), carrying ``metadata``."""
        region = self.spare
        assert region is not None
        return RingUpdate(ring_version=version or self.version_in_force() + 1,
                          name=region.name, base_address=region.base_address,
                          size_bytes=region.size_bytes, kind=region.kind.value,
                          device_id=region.device_id,
                          transport_metadata_b64=base64.b64encode(metadata).decode())

    def send(self, payload: bytes) -> None:
        self.transport.send_message(self.prefill.agent_name, payload)

    def send_sealed(self, message: RingUpdate) -> bytes:
        """``message`` sealed with the key of mallory's pair with the prefill rank."""
        identity = self.receiver.pod_identity
        assert identity is not None and self.prefill.credential is not None
        framer = self.group.auth.pair(identity, verify_credential(
            self.prefill.credential, self.group.auth.authorities))
        frame = framer.seal(encode_message(message), purpose=Purpose.MESSAGE,
                            version=PROTOCOL_VERSION, sender=self.name,
                            receiver=self.prefill.agent_name, confidential=True)
        self.send(frame)
        return frame

    def close(self) -> None:
        self.server.close()
        self.receiver.close()


@pytest.fixture(scope="module")
def group() -> Iterator[SelftestGroup]:
    group = SelftestGroup(CONFIG)
    try:
        yield group
    finally:
        group.close()


def _prefill_rejected(group: SelftestGroup) -> dict[str, int]:
    (stats,) = group.broadcast("prefill", "stats")
    return dict(stats["rejected"])


def _wait_rejected(group: SelftestGroup, total: int, senders: list[NixlTransport],
                   timeout_s: float = 30.0) -> dict[str, int]:
    """The prefill's rejection counts once they reach ``total`` (or at the deadline); the
    attackers' transports are progressed meanwhile (no progress thread: unsent otherwise)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for transport in senders:
            transport.poll_messages()
        rejected = _prefill_rejected(group)
        if sum(rejected.values()) >= total or time.monotonic() > deadline:
            return rejected
        time.sleep(0.01)


def _assert_serves_bit_exactly(group: SelftestGroup) -> None:
    _, results = group.run_wave(group.make_requests(2))
    assert {(r["role"], r["state"]) for r in results} == {("decode", "Succeeded"),
                                                          ("prefill", "Succeeded")}
    assert [r["verified"] for r in results if r["role"] == "decode"] == [True, True]


def _outcome(group: SelftestGroup, mallory: Mallory, version: int,
             before: dict[str, int]) -> str:
    """What prefill did with the update just sent: "loaded" (mallory's ring version moved)
    or the reason it was refused; "lost" if neither within 10 s."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        mallory.transport.poll_messages()
        grown = {k: v - before.get(k, 0) for k, v in _prefill_rejected(group).items()
                 if v > before.get(k, 0)}
        if grown:
            return "+".join(sorted(grown))
        if mallory.version_in_force() > version:
            return "loaded"
        time.sleep(0.002)
    return "lost"


def _mutate(blob: bytes, at: int, value: int) -> bytes:
    out = bytearray(blob)
    out[at] = value if value != out[at] else value ^ 0xFF
    return bytes(out)


def test_hostile_metadata_never_reaches_nixl_and_prefill_keeps_serving(
        group: SelftestGroup) -> None:
    """One RingUpdate with a few metadata bytes changed used to make UCX abort the prefill
    process (add_remote_agent), and metadata naming another agent used to change transport
    state before it was refused. Neither may happen, from an unauthenticated peer or from
    an authenticated one (docs/failure-modes.md #26)."""
    _assert_serves_bit_exactly(group)
    assert _prefill_rejected(group) == {}
    mallory = Mallory(group)
    try:
        (names,) = group.broadcast("prefill", "peers", [mallory.server.address])
        assert names == [mallory.name]
        own = mallory.transport.local_metadata()
        victim = fetch_document(group.addresses[DECODE], 30.0, group.auth)
        name_at = own.index(mallory.name.encode())
        conn_at = own.index(b"|c") + 2 + 8  # first byte of the UCX worker address
        mem_type_at = own.index(b"nixlSDList|t") + len(b"nixlSDList|t") + 8
        authenticated = [
            victim.transport_metadata,  # names another (connected) agent: the victim
            _mutate(own, name_at + 2, ord("X")),  # names an agent that does not exist
            _mutate(own, conn_at, 0x7F),  # the UCX address version byte (the abort)
            _mutate(own, conn_at + 20, 0x00),
            _mutate(own, own.index(b"Conns") + 5, 0x09),  # a framing length
            _mutate(own, mem_type_at, 0x05),  # an unknown memory type
            own[:-1],  # truncated
            own + b"\x00",  # trailing bytes
            b"\x00" * 64,  # not NIXL metadata at all
        ]
        replayable = b""
        for metadata in authenticated:
            replayable = mallory.send_sealed(mallory.ring_update(metadata))
        # The stranger: no key, no document any rank checked. Unframed, sealed with another
        # key, and mallory's valid frame replayed from its own agent: no pair key is known for
        # its name, so none is opened.
        stranger = NixlTransport(f"stranger-{uuid.uuid4().hex[:8]}")
        stranger.add_peer(mallory.prefill.transport_metadata,
                          expected_name=mallory.prefill.agent_name)
        unframed = encode_message(mallory.ring_update(_mutate(own, conn_at, 0x7F)))
        other_key = seal_as(stranger.agent_name, mallory.prefill.agent_name,
                            mallory.ring_update(_mutate(own, conn_at, 0x7F)),
                            PeerAuth.generate())
        for payload in (unframed, other_key, replayable):
            stranger.send_message(mallory.prefill.agent_name, payload)
        expected = {"invalid_ring_update": len(authenticated), "unknown_peer": 3}
        attackers = [mallory.transport, stranger]
        assert _wait_rejected(group, sum(expected.values()), attackers) == expected
        assert group.ranks[PREFILL][0].is_alive()
        _assert_serves_bit_exactly(group)  # the victim's connection is untouched

        # Fuzzed: each update announces a buffer registered just before, so its metadata
        # passes the ring checks and goes on to the parser, the vetter and NIXL.
        rng = random.Random(12)
        outcomes: Counter[str] = Counter()
        for _ in range(FUZZED):
            mallory.spare = mallory.register_spare()
            blob = mallory.transport.local_metadata()
            for _ in range(rng.randint(1, 4)):
                blob = _mutate(blob, rng.randrange(len(blob)), rng.randrange(256))
            version, before = mallory.version_in_force(), _prefill_rejected(group)
            mallory.send_sealed(mallory.ring_update(blob, version + 1))
            outcomes[_outcome(group, mallory, version, before)] += 1
        # Every fuzzed update is refused (counted: its metadata does not parse, is not vetted,
        # or no longer registers the announced buffer) or loaded as mallory's own update.
        print(f"{FUZZED} fuzzed RingUpdates: {dict(outcomes)}")
        assert sum(outcomes.values()) == FUZZED and outcomes["invalid_ring_update"] > 0, outcomes
        assert set(outcomes) <= {"loaded", "invalid_ring_update", "unregistered_ring"}, outcomes
        assert group.ranks[PREFILL][0].is_alive()
        _assert_serves_bit_exactly(group)
        stranger.close()
    finally:
        mallory.close()


def test_a_peer_without_the_key_cannot_join(group: SelftestGroup) -> None:
    """docs/failure-modes.md #26: a bootstrap document signed with another key is refused by
    the prefill before it parses it, and no peer is added."""
    auth = PeerAuth.generate()
    transport = NixlTransport(f"outsider-{uuid.uuid4().hex[:8]}")
    document = RankDocument.model_validate(fetch_document(
        group.addresses[DECODE], 30.0, group.auth).model_dump() | {
            "agent_name": transport.agent_name,
            "transport_metadata_b64": base64.b64encode(transport.local_metadata()).decode()})
    server = BootstrapServer(lambda: document, auth)
    try:
        (answer,) = group.broadcast("prefill", "peers", [server.address])
        assert answer[0] == "error"
        assert f"{server.address}/v1/rank: unauthenticated bootstrap document" in answer[1]
    finally:
        server.close()
        transport.close()
    assert group.ranks[PREFILL][0].is_alive()
    _assert_serves_bit_exactly(group)
