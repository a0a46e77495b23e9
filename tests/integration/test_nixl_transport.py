"""NixlTransport against a real NIXL agent in a second process (UCX over loopback).

The peer process is a small command loop (``_peer_main``): it owns a decode-side landing
buffer and reports, for every message it receives, a hash of that buffer *at the moment the
message was observed*: that is how "the notification arrives only after the data" is
asserted. Every wait is bounded; both agents run without a progress thread and poll.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from pd_transfer.errors import DescriptorOutOfBounds, PeerUnreachable, TransportError
from pd_transfer.transport import RegisteredRegion, TransferHandle, TransferState
from pd_transfer.transport.nixl import NixlTransport

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

KIB = 1024
LANDING_BYTES = 1024 * KIB
DEADLINE_S = 10.0
INBOX: list[tuple[str, bytes]] = []  # every message the test process polled, in order


def _digest(buffer: torch.Tensor) -> str:
    return hashlib.sha256(buffer.cpu().numpy().tobytes()).hexdigest()


def _peer_main(conn: Connection, name: str, device: str) -> None:
    """Child process: a decode agent driven by (command, *args) tuples over ``conn``."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    transport = NixlTransport(name)
    landing = torch.zeros(LANDING_BYTES, dtype=torch.uint8, device=device)
    region = transport.register(landing, name="landing")
    conn.send((transport.local_metadata(), region))
    received: list[tuple[str, bytes, str]] = []
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        for peer, payload in transport.poll_messages():
            received.append((peer, payload, _digest(landing)))
        if not conn.poll(0.0005):
            continue
        command, *args = conn.recv()
        if command == "add_peer":
            conn.send(transport.add_peer(args[0], expected_name=args[1]))
        elif command == "send":
            transport.send_message(args[0], args[1])
            conn.send("sent")
        elif command == "received":
            conn.send(list(received))
        elif command == "landing":
            conn.send(landing.cpu().clone())
        elif command == "exit":
            transport.close()
            conn.send("bye")
            return


@dataclass
class Peer:
    process: Any  # multiprocessing SpawnProcess
    conn: Connection
    name: str
    metadata: bytes
    region: RegisteredRegion

    def ask(self, local: NixlTransport, *command: object) -> Any:
        """Send a command and wait for its reply, progressing ``local`` meanwhile."""
        self.conn.send(command)
        return wait_for(lambda: self.conn.recv() if self.conn.poll(0.0005) else None, local)


def wait_for(probe: Callable[[], Any], local: NixlTransport, timeout: float = DEADLINE_S) -> Any:
    """Poll ``probe`` (progressing ``local``) until it returns non-None; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = probe()
        if result is not None:
            return result
        INBOX.extend(local.poll_messages())
    pytest.fail(f"no result within {timeout} s")


def wait_state(local: NixlTransport, handle: TransferHandle) -> TransferState:
    """The handle's terminal state, or fail after DEADLINE_S."""
    return wait_for(  # type: ignore[no-any-return]
        lambda: s if (s := local.state(handle)) is not TransferState.PENDING else None, local
    )


def start_peer(local: NixlTransport, name: str, device: str = "cpu") -> Peer:
    """Spawn a peer and exchange metadata both ways (as the control plane would)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_peer_main, args=(child, name, device), daemon=True)
    process.start()
    if not parent.poll(30.0):
        process.kill()
        pytest.fail("peer process did not start within 30 s")
    metadata, region = parent.recv()
    peer = Peer(process, parent, name, metadata, region)
    assert local.add_peer(metadata, expected_name=name) == name
    assert peer.ask(local, "add_peer", local.local_metadata(), local.agent_name) == local.agent_name
    return peer


def stop_peer(peer: Peer) -> None:
    if peer.process.is_alive():
        peer.conn.send(("exit",))
        if peer.conn.poll(5.0):
            peer.conn.recv()
        peer.process.join(5.0)
    if peer.process.is_alive():
        peer.process.kill()
        peer.process.join(5.0)


@pytest.fixture(scope="module")
def local() -> Iterator[NixlTransport]:
    os.environ["UCX_NET_DEVICES"] = "lo"
    transport = NixlTransport(f"prefill-{os.getpid()}")
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def source(local: NixlTransport) -> tuple[torch.Tensor, RegisteredRegion]:
    """A 2 MiB source with a byte pattern that differs at every offset modulo 251."""
    tensor = (torch.arange(2 * LANDING_BYTES, dtype=torch.int64) % 251).to(torch.uint8)
    return tensor, local.register(tensor, name="source")


@pytest.fixture(scope="module")
def peer(local: NixlTransport) -> Iterator[Peer]:
    started = start_peer(local, f"decode-{os.getpid()}")
    yield started
    stop_peer(started)


def test_metadata_exchange_names_both_agents(local: NixlTransport, peer: Peer) -> None:
    assert peer.region.size_bytes == LANDING_BYTES
    assert peer.name in local._peers


def test_scattered_write_is_one_request_and_notification_follows_data(
    local: NixlTransport, peer: Peer, source: tuple[torch.Tensor, RegisteredRegion]
) -> None:
    """Guards docs/failure-modes.md #9: when the notification is observed, every byte is already
    there."""
    tensor, region = source
    count, size, stride = 256, 2 * KIB, 4 * KIB  # 256 spans, every other 2 KiB of the source
    local_spans = [(region.base_address + i * stride, size) for i in range(count)]
    remote_spans = [(peer.region.base_address + i * size, size) for i in range(count)]
    before = local.stats.snapshot()

    handle = local.write(peer.name, local_spans, remote_spans, [peer.region], b"req-7")
    assert wait_state(local, handle) is TransferState.DONE
    local.release(handle)

    expected = torch.zeros(LANDING_BYTES, dtype=torch.uint8)
    for i in range(count):  # hand-built: span i of the source lands at i * size
        expected[i * size : (i + 1) * size] = tensor[i * stride : i * stride + size]
    received = wait_for(
        lambda: [m for m in peer.ask(local, "received") if m[1] == b"req-7"] or None, local
    )
    assert [(sender, payload) for sender, payload, _ in received] == [(local.agent_name, b"req-7")]
    assert received[0][2] == _digest(expected)  # the buffer as the peer saw it on arrival
    assert torch.equal(peer.ask(local, "landing"), expected)
    after = local.stats
    assert after.transfers_posted - before.transfers_posted == 1
    assert after.descriptors_posted - before.descriptors_posted == count
    assert after.bytes_posted - before.bytes_posted == count * size


def test_control_messages_flow_both_ways(local: NixlTransport, peer: Peer) -> None:
    local.send_message(peer.name, b"hello-decode")
    assert peer.ask(local, "send", local.agent_name, b"hello-prefill") == "sent"
    wait_for(lambda: (peer.name, b"hello-prefill") in INBOX or None, local)
    seen = wait_for(
        lambda: [m[:2] for m in peer.ask(local, "received") if m[1] == b"hello-decode"] or None,
        local,
    )
    assert seen == [(local.agent_name, b"hello-decode")]
    assert local.stats.messages_sent >= 1 and local.stats.messages_received >= 1


def test_out_of_bounds_descriptor_is_rejected_before_posting(
    local: NixlTransport, peer: Peer, source: tuple[torch.Tensor, RegisteredRegion]
) -> None:
    """Guards docs/failure-modes.md #15 on the real path: nothing is posted, the peer sees
    nothing."""
    _, region = source
    before = local.stats.snapshot()
    past_end = peer.region.end_address - KIB // 2  # last 512 bytes in, 512 bytes out
    with pytest.raises(DescriptorOutOfBounds, match="remote descriptor #0"):
        local.write(peer.name, [(region.base_address, KIB)], [(past_end, KIB)], [peer.region], b"x")
    with pytest.raises(DescriptorOutOfBounds, match="local descriptor #0"):
        local.write(
            peer.name,
            [(region.end_address - 16, KIB)],
            [(peer.region.base_address, KIB)],
            [peer.region],
            b"x",
        )
    assert local.stats == before


def test_region_the_peer_never_registered_is_refused_by_nixl(
    local: NixlTransport, peer: Peer, source: tuple[torch.Tensor, RegisteredRegion]
) -> None:
    """A forged grant passes our check; NIXL's metadata check then refuses it (stale peer)."""
    _, region = source
    forged = RegisteredRegion("forged", peer.region.end_address + 4096, 4096, peer.region.kind, 0)
    with pytest.raises(DescriptorOutOfBounds, match="stale"):
        local.write(
            peer.name, [(region.base_address, KIB)], [(forged.base_address, KIB)], [forged], b"x"
        )


def test_a_prepared_write_moves_what_the_source_holds_at_its_post_once(
    local: NixlTransport, peer: Peer, source: tuple[torch.Tensor, RegisteredRegion]
) -> None:
    """``prepare_write`` builds NIXL's request and posts nothing; ``post`` sends the bytes the
    source holds then (written after the prepare here), once; a discarded one never goes."""
    tensor, region = source
    at, size = 8 * KIB, 64 * KIB
    target = (peer.region.base_address + 512 * KIB, size)
    before = local.stats.snapshot()
    prepared = local.prepare_write(peer.name, [(region.base_address + at, size)], [target],
                                   [peer.region], b"prepared-1")
    unused = local.prepare_write(peer.name, [(region.base_address, size)], [target],
                                 [peer.region], b"never-posted")
    assert local.stats == before
    local.discard(unused)
    local.discard(unused)  # idempotent
    original = tensor[at : at + size].clone()
    tensor[at : at + size] = 7
    try:
        handle = local.post(prepared)
        assert wait_state(local, handle) is TransferState.DONE
        local.release(handle)
        for spent in (prepared, unused):
            with pytest.raises(TransportError, match="posted or discarded"):
                local.post(spent)
        received = wait_for(lambda: [m[1] for m in peer.ask(local, "received")
                                     if m[1] in (b"prepared-1", b"never-posted")] or None, local)
        assert received == [b"prepared-1"]
        landing = peer.ask(local, "landing")
        assert torch.equal(landing[512 * KIB : 512 * KIB + size],
                           torch.full((size,), 7, dtype=torch.uint8))
        assert local.stats.transfers_posted - before.transfers_posted == 1
    finally:
        tensor[at : at + size] = original


def test_killed_peer_surfaces_as_unreachable_within_a_deadline(
    local: NixlTransport, source: tuple[torch.Tensor, RegisteredRegion]
) -> None:
    """Guards docs/failure-modes.md #19: a SIGKILLed peer is an error within seconds, never a
    hang."""
    _, region = source
    victim = start_peer(local, f"victim-{os.getpid()}")
    spans = ([(region.base_address, 64 * KIB)], [(victim.region.base_address, 64 * KIB)])
    first = local.write(victim.name, *spans, [victim.region], b"warm-up")
    assert wait_state(local, first) is TransferState.DONE
    local.release(first)

    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.join(5.0)
    started = time.monotonic()
    outcome: str | None = None
    while outcome is None and time.monotonic() - started < 5.0:
        try:
            handle = local.write(victim.name, *spans, [victim.region], b"after-death")
        except PeerUnreachable:
            outcome = "unreachable"
            break
        state = wait_state(local, handle)
        local.release(handle)
        if state is TransferState.FAILED:
            outcome = "failed"
    assert outcome is not None, "a killed peer was still writable after 5 s"
    with pytest.raises(PeerUnreachable):
        local.send_message(victim.name, b"are you there")
    local.remove_peer(victim.name)
    local.remove_peer(victim.name)
    with pytest.raises(PeerUnreachable, match="not added"):
        local.send_message(victim.name, b"x")


@pytest.mark.gpu
def test_vram_write_lands_bit_exact(local: NixlTransport) -> None:
    source = (torch.arange(LANDING_BYTES, device="cuda") % 253).to(torch.uint8)
    region = local.register(source, name="vram-source")
    gpu_peer = start_peer(local, f"decode-gpu-{os.getpid()}", device="cuda")
    try:
        handle = local.write(
            gpu_peer.name,
            [(region.base_address, LANDING_BYTES)],
            [(gpu_peer.region.base_address, LANDING_BYTES)],
            [gpu_peer.region],
            b"vram",
        )
        assert wait_state(local, handle) is TransferState.DONE
        local.release(handle)
        assert torch.equal(gpu_peer.ask(local, "landing"), source.cpu())
    finally:
        stop_peer(gpu_peer)
        local.deregister(region)
