"""Untrusted NIXL metadata against a real NIXL agent in a victim process (UCX over lo):
a blob that crashes UCX kills a vetting process, not the victim; a blob NIXL refuses does
not poison later legitimate loads of the same agent (docs/failure-modes.md #26).

The victim is a spawned process driving a ``NixlTransport`` (``_victim_main``), so a crash
shows as its death, not pytest's. The peers whose metadata it loads live in the test
process; they are progressed while the victim works (UCX's wire-up needs both sides) and
receive its WRITEs, whose bytes are checked exactly. The corruptions were measured with
nixl 1.5.1 / its bundled UCX, each in a process of its own:

* the first byte of the UCX worker address (its version) set to 0x7f: ``add_remote_agent``
  aborts the process (SIGABRT, UCX's address-version assertion);
* byte 8 of a region's UCX remote key (its memory type) set to 0x80: SIGSEGV, for a new agent
  and for a known one whose endpoint is wired up, in the engine; a vetting process without
  torch loaded survived it (UCX reads past a table: what lies there decides), so the key's
  framing and memory type are checked before any NIXL sees it (``nixl_metadata``);
* byte 0 of a remote key (its memory-domain map) set to 0x02 (another memory domain): NIXL
  refuses the load (NIXL_ERR_BACKEND), and afterwards refused every load of that agent name
  (NIXL_ERR_INVALID_PARAM): UCX kept an endpoint under the name that NIXL had forgotten.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from nixl._api import nixl_agent

from pd_transfer.errors import TransferError
from pd_transfer.transport import RegisteredRegion, TransferState
from pd_transfer.transport.nixl import NixlConfig, NixlTransport
from pd_transfer.transport.nixl_admission import MAX_SOURCE_DEATHS
from pd_transfer.transport.nixl_metadata import (
    NixlMetadata,
    encode_nixl_metadata,
    parse_nixl_metadata,
)
from pd_transfer.transport.nixl_vetter import (
    MetadataVetter,
    Verdict,
    VetOutcome,
    VetterSpec,
    VettingStats,
)

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

KIB = 1024
SOURCE_BYTES = 64 * KIB
DEADLINE_S = 30.0
ADDRESS_VERSION, KEY_MD_MAP, KEY_MEM_TYPE = "address version", 0, 8


def _pattern(size: int, seed: int) -> torch.Tensor:
    """Bytes that differ at every offset modulo 251, shifted by ``seed``."""
    return ((torch.arange(size, dtype=torch.int64) + seed) % 251).to(torch.uint8)


def _victim_main(conn: Connection, name: str, options: dict[str, Any]) -> None:
    """Child process: a NixlTransport driven by (command, *args) tuples over ``conn``;
    every reply is ("ok", value) or ("error", exception class, message)."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    transport = NixlTransport(name, NixlConfig(**options))
    source = transport.register(_pattern(SOURCE_BYTES, 3), name="source")
    conn.send(("ok", transport.agent_name))
    while True:
        command, *args = conn.recv()
        try:
            if command == "exit":
                transport.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", _victim_command(transport, source, command, args)))
        except TransferError as exc:
            conn.send(("error", type(exc).__name__, str(exc)))


def _victim_command(transport: NixlTransport, source: RegisteredRegion, command: str,
                    args: list[Any]) -> Any:
    if command == "add_peer":
        return transport.add_peer(args[0], expected_name=args[1])
    if command == "timed_add_peer":  # seconds add_peer took, measured in the victim
        started = time.perf_counter()
        transport.add_peer(args[0], expected_name=args[1])
        return time.perf_counter() - started
    if command == "write":  # the source's first bytes over the whole remote region
        peer, remote, notification = args
        handle = transport.write(peer, [(source.base_address, remote.size_bytes)],
                                 [(remote.base_address, remote.size_bytes)], [remote],
                                 notification)
        deadline = time.monotonic() + DEADLINE_S
        while (state := transport.state(handle)) is TransferState.PENDING:
            if time.monotonic() > deadline:
                break
        transport.release(handle)
        return state.value
    if command == "vetting":
        return dataclasses.asdict(transport.vetting)
    raise ValueError(f"unknown command {command!r}")


class Victim:
    """The victim process and the peers (in this process) progressed while it works."""

    def __init__(self, options: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name = f"victim-{uuid.uuid4().hex[:8]}"
        self.process = ctx.Process(target=_victim_main, args=(child, self.name, options),
                                   daemon=True)
        self.process.start()
        self.peers: list[NixlTransport] = []
        self.landings: dict[str, torch.Tensor] = {}  # region name -> the tensor registered
        self.inbox: list[tuple[str, bytes]] = []
        assert self._reply() == ("ok", self.name)

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def peer(self, size: int = 16 * KIB, name: str = "") -> tuple[NixlTransport, RegisteredRegion]:
        """A new agent in this process (``name``, or a fresh one) with one zeroed region."""
        peer = NixlTransport(name or f"peer-{uuid.uuid4().hex[:8]}", NixlConfig(vet_metadata=False))
        self.peers.append(peer)
        return peer, self.register(peer, size)

    def register(self, peer: NixlTransport, size: int) -> RegisteredRegion:
        """A zeroed region of ``size`` bytes, registered with ``peer``."""
        landing = torch.zeros(size, dtype=torch.uint8)
        region = peer.register(landing)
        self.landings[region.name] = landing
        return region

    def ask(self, *command: Any) -> tuple[Any, ...]:
        self.conn.send(command)
        return self._reply()

    def add_peer(self, metadata: bytes, name: str) -> tuple[Any, ...]:
        return self.ask("add_peer", metadata, name)

    def _reply(self) -> tuple[Any, ...]:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                if self.conn.poll(0.001):
                    return tuple(self.conn.recv())
            except EOFError:  # it died: its exit code is minus the signal that killed it
                self.process.join(10.0)
                return ("died", self.process.exitcode)
            for peer in self.peers:
                self.inbox.extend(peer.poll_messages())
        pytest.fail(f"the victim did not answer within {DEADLINE_S} s")

    def assert_writes(self, peer: NixlTransport, region: RegisteredRegion, tag: bytes) -> None:
        """A real WRITE of the victim's source over ``region``: DONE, its notification
        arrives after the data, and the bytes are exactly the source's."""
        landing = self.landings[region.name]
        landing.zero_()
        assert self.ask("write", peer.agent_name, region, tag) == ("ok", "done")
        deadline = time.monotonic() + DEADLINE_S
        while (self.name, tag) not in self.inbox and time.monotonic() < deadline:
            self.inbox.extend(peer.poll_messages())
        assert (self.name, tag) in self.inbox
        assert torch.equal(landing, _pattern(SOURCE_BYTES, 3)[:region.size_bytes])

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(("exit",))
            self.conn.poll(10.0)
        self.process.join(10.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        for peer in self.peers:
            peer.close()


@pytest.fixture
def make_victim() -> Iterator[Callable[[dict[str, Any]], Victim]]:
    """Starts victims with these ``NixlConfig`` options; closes them afterwards."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    started: list[Victim] = []

    def start(options: dict[str, Any]) -> Victim:
        started.append(Victim(options))
        return started[-1]

    try:
        yield start
    finally:
        for each in started:
            each.close()


@pytest.fixture
def victim(make_victim: Callable[[dict[str, Any]], Victim]) -> Victim:
    return make_victim({})


def _vetting_processes(parent: int) -> list[int]:
    """The pids of ``parent``'s live vetting processes (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[1]) == parent and fields[0] != "Z" and b"nixl_vetter" in command:
            found.append(int(entry.name))
    return found


def _corrupt(blob: bytes, name: str, where: str | int, value: int,
             region: RegisteredRegion | None = None) -> bytes:
    """``blob`` with one byte set to ``value``: the UCX address version, or byte ``where``
    of ``region``'s remote key."""
    metadata = parse_nixl_metadata(blob, name)
    if where == ADDRESS_VERSION:
        ((_, connection),) = metadata.connections
        at = blob.index(connection)
    else:
        assert region is not None and isinstance(where, int)
        (descriptor,) = [d for s in metadata.sections for d in s.descriptors
                         if d.address == region.base_address]
        head = struct.pack("<QQQ", descriptor.address, descriptor.length, descriptor.device)
        at = blob.index(head + descriptor.backend_key) + len(head) + where
    assert blob[at] != value
    return blob[:at] + bytes([value]) + blob[at + 1:]


def test_a_new_agent_whose_address_aborts_ucx_kills_only_a_vetting_process(
        victim: Victim) -> None:
    """An agent's first metadata with another UCX address version used to abort the loading
    process: a vetting process dies instead, the load is refused naming that, and the same
    process then loads that agent's real metadata and a new agent's, and moves data."""
    mallory, mallory_region = victim.peer()
    hostile = _corrupt(mallory.local_metadata(), mallory.agent_name, ADDRESS_VERSION, 0x7F)
    answer = victim.add_peer(hostile, mallory.agent_name)
    assert answer[0] == "error", f"the victim answered {answer} (a negative code: its signal)"
    assert answer[1] == "TransportError"
    assert f"transport metadata of agent {mallory.agent_name!r} killed a vetting process " \
           "(SIGABRT); not loaded" in answer[2]
    assert victim.process.is_alive()

    decode, region = victim.peer()
    assert victim.add_peer(decode.local_metadata(), decode.agent_name) == (
        "ok", decode.agent_name)
    victim.assert_writes(decode, region, b"after-abort")
    assert victim.add_peer(mallory.local_metadata(), mallory.agent_name) == (
        "ok", mallory.agent_name)
    victim.assert_writes(mallory, mallory_region, b"mallory-real")
    (_, stats) = victim.ask("vetting")
    assert stats["deaths"] == 1 and stats["starts"] == 2 and stats["vetted"] == 2


@pytest.mark.parametrize(("where", "value", "refusal"), [
    (KEY_MEM_TYPE, 0x80, "malformed NIXL metadata ({size} bytes): a UCX remote key of memory "
                         "type 128 (UCX knows 0 to 9)"),
    (KEY_MD_MAP, 0x02, "transport metadata of agent {peer!r} was refused by NIXL in a vetting "
                       "process (nixlBackendError: NIXL_ERR_BACKEND); not loaded"),
], ids=["segfaulting-memory-type", "refused-memory-domain"])
def test_a_reload_whose_new_remote_key_is_hostile_is_refused_and_the_agent_still_works(
        victim: Victim, where: int, value: int, refusal: str) -> None:
    """A known agent's reload (a RingUpdate) with one new region whose remote key made UCX
    segfault used to kill the loading process, and one NIXL refused dropped the agent in it
    (its messages and WRITEs failed from then on, and so did every reload): refused instead,
    the agent still works, and its legitimate reload with that region then loads and a WRITE
    into the new region lands bit-exactly."""
    peer, first = victim.peer()
    assert victim.add_peer(peer.local_metadata(), peer.agent_name) == ("ok", peer.agent_name)
    second = victim.register(peer, 32 * KIB)
    reload = peer.local_metadata()
    hostile = _corrupt(reload, peer.agent_name, where, value, second)
    answer = victim.add_peer(hostile, peer.agent_name)
    assert answer[0] == "error", f"the victim answered {answer} (a negative code: its signal)"
    assert refusal.format(size=len(hostile), peer=peer.agent_name) in answer[2]
    victim.assert_writes(peer, first, b"old-region")  # the loaded agent is untouched

    assert victim.add_peer(reload, peer.agent_name) == ("ok", peer.agent_name)
    victim.assert_writes(peer, second, b"new-region")
    victim.assert_writes(peer, first, b"old-region-again")
    (_, stats) = victim.ask("vetting")
    assert stats["deaths"] == 0 and stats["vetted"] == 2  # the agent, then its new region


def test_metadata_nixl_refuses_does_not_poison_the_agent_name(victim: Victim) -> None:
    """A blob NIXL refuses without crashing (a remote key for another memory domain)
    used to leave UCX's endpoint under the agent's name, so every later load of that agent
    failed NIXL_ERR_INVALID_PARAM. With vetting the victim's NIXL never sees it; its
    legitimate metadata then loads and works."""
    peer, region = victim.peer()
    metadata = peer.local_metadata()
    answer = victim.add_peer(_corrupt(metadata, peer.agent_name, KEY_MD_MAP, 0x02, region),
                             peer.agent_name)
    assert answer[:2] == ("error", "TransportError")
    assert f"transport metadata of agent {peer.agent_name!r} was refused by NIXL in a " \
           "vetting process" in answer[2]
    assert "NIXL_ERR_BACKEND" in answer[2]
    assert victim.add_peer(metadata, peer.agent_name) == ("ok", peer.agent_name)
    victim.assert_writes(peer, region, b"after-refusal")
    (_, stats) = victim.ask("vetting")
    assert stats["refused"] == 1 and stats["deaths"] == 0


def test_a_load_refused_by_the_engines_own_nixl_is_cleaned_up(
        make_victim: Callable[[dict[str, Any]], Victim]) -> None:
    """Without vetting (or should a blob pass it and fail anyway) NIXL refuses the load in
    the engine itself: the agent's later legitimate metadata still loads and moves data, for
    a new agent and for a known one whose reload was refused (NIXL forgets the agent)."""
    victim = make_victim({"vet_metadata": False})
    peer, region = victim.peer()
    metadata = peer.local_metadata()
    for _ in range(2):  # refused twice: each refusal is cleaned up
        answer = victim.add_peer(
            _corrupt(metadata, peer.agent_name, KEY_MD_MAP, 0x02, region), peer.agent_name)
        assert answer[:2] == ("error", "TransportError") and "NIXL_ERR_BACKEND" in answer[2]
    assert victim.add_peer(metadata, peer.agent_name) == ("ok", peer.agent_name)
    victim.assert_writes(peer, region, b"new-agent")

    second = victim.register(peer, 8 * KIB)
    reload = peer.local_metadata()
    answer = victim.add_peer(_corrupt(reload, peer.agent_name, KEY_MD_MAP, 0x02, second),
                             peer.agent_name)
    assert answer[:2] == ("error", "TransportError") and "NIXL_ERR_BACKEND" in answer[2]
    assert victim.add_peer(reload, peer.agent_name) == ("ok", peer.agent_name)
    victim.assert_writes(peer, second, b"known-agent")
    victim.assert_writes(peer, region, b"known-agent-first-region")


def test_a_stalled_vetting_process_is_killed_and_replaced_and_ends_with_the_transport(
        make_victim: Callable[[dict[str, Any]], Victim]) -> None:
    """A vetting process that does not answer in time (here: stopped) condemns the blob and
    is killed; the next blob starts a new one; closing the transport ends it."""
    victim = make_victim({"vet_timeout_s": 1.0})
    first, _ = victim.peer()
    assert victim.add_peer(first.local_metadata(), first.agent_name)[0] == "ok"
    (vetter,) = _vetting_processes(victim.pid)
    os.kill(vetter, signal.SIGSTOP)
    peer, region = victim.peer()
    answer = victim.add_peer(peer.local_metadata(), peer.agent_name)
    assert answer[:2] == ("error", "TransportError")
    assert f"transport metadata of agent {peer.agent_name!r} stalled a vetting process (no " \
           "answer within 1 s; killed); not loaded" in answer[2]
    assert vetter not in _vetting_processes(victim.pid)  # killed and reaped

    assert victim.add_peer(peer.local_metadata(), peer.agent_name) == ("ok", peer.agent_name)
    victim.assert_writes(peer, region, b"after-stall")
    (_, stats) = victim.ask("vetting")
    assert stats == {"starts": 2, "vetted": 2, "refused": 0, "deaths": 1, "remembered": 0}
    (replacement,) = _vetting_processes(victim.pid)
    assert victim.ask("exit") == ("ok", None)
    deadline = time.monotonic() + DEADLINE_S
    while Path(f"/proc/{replacement}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the victim reaped it in close(); /proc may lag a moment
    assert not Path(f"/proc/{replacement}").exists()


def _wait_for_vetter(victim: Victim) -> int:
    """The victim's one vetting process, once it exists."""
    deadline = time.monotonic() + DEADLINE_S
    while not (found := _vetting_processes(victim.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    (pid,) = found
    return pid


def test_the_vetting_process_starts_with_the_transport_not_on_a_first_contact(
        victim: Victim) -> None:
    """Guards against a first contact that waits for a vetting process to start (1.7 s on
    a GPU host, against 12.5 ms without vetting): it is running before any peer comes, and
    the first add_peer uses it."""
    vetter = _wait_for_vetter(victim)
    time.sleep(2.0)  # let it finish its start (a cold NIXL import on 2 cores: about 0.6 s)
    peer, region = victim.peer()
    (_, took) = victim.ask("timed_add_peer", peer.local_metadata(), peer.agent_name)
    print(f"first contact with a warm vetting process: {took * 1000:.1f} ms")
    assert took < 0.5, took  # a start alone takes longer than this here
    assert _vetting_processes(victim.pid) == [vetter]
    victim.assert_writes(peer, region, b"first-contact")
    (_, stats) = victim.ask("vetting")
    assert stats == {"starts": 1, "vetted": 1, "refused": 0, "deaths": 0, "remembered": 0}


def test_a_vetting_process_that_does_not_read_is_killed_at_the_deadline() -> None:
    """Guards against a write to the vetting process without a deadline: a 132 KB blob to
    one that does not read blocked the rank's worker thread (and every transfer of the
    rank) until it was killed, 43 s later."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    peer = NixlTransport(f"peer-{uuid.uuid4().hex[:8]}", NixlConfig(vet_metadata=False))
    vetter = MetadataVetter(VetterSpec("deadline", nixl_agent.__module__, ("UCX",), 0,
                                       tuple(os.environ.items()), timeout_s=1.0))
    try:
        vetter.start()
        legit = parse_nixl_metadata(peer.local_metadata(), peer.agent_name)
        assert vetter.vet(legit).outcome is VetOutcome.LOADED
        (pid,) = _vetting_processes(os.getpid())
        os.kill(pid, signal.SIGSTOP)
        ((backend, connection),) = legit.connections
        big = dataclasses.replace(legit, connections=((backend, connection * 2048),))
        size = len(encode_nixl_metadata(dataclasses.replace(big, agent_name="vetted-2")))
        assert size > 132 * KIB
        started = time.monotonic()
        verdict = vetter.vet(big)
        took = time.monotonic() - started
        assert verdict == Verdict(outcome=VetOutcome.STALLED, detail=(
            f"it did not read a blob of {size} bytes within 1 s; killed"))
        assert took < 2.0, took
        assert pid not in _vetting_processes(os.getpid())
        assert vetter.stats == VettingStats(starts=2, vetted=1, deaths=1)  # replaced at once
    finally:
        vetter.close()
        peer.close()


def test_a_blob_that_killed_a_vetting_process_is_remembered_not_vetted_again(
        victim: Victim) -> None:
    """Guards against a lethal blob that costs a vetting process (and a start on the
    worker thread) every time it is sent: the second time it is refused from memory, and
    the replacement started right after the first death serves the next peer."""
    _wait_for_vetter(victim)
    mallory, _ = victim.peer()
    hostile = _corrupt(mallory.local_metadata(), mallory.agent_name, ADDRESS_VERSION, 0x7F)
    first = victim.add_peer(hostile, mallory.agent_name)
    assert first[:2] == ("error", "TransportError") and "(SIGABRT)" in first[2], first
    replacement = _wait_for_vetter(victim)
    again = victim.add_peer(hostile, mallory.agent_name)
    assert again[:2] == ("error", "TransportError")
    assert "killed a vetting process (SIGABRT; this blob was condemned " in again[2], again
    assert "s ago, not vetted again); not loaded" in again[2], again
    assert _vetting_processes(victim.pid) == [replacement]
    peer, region = victim.peer()
    assert victim.add_peer(peer.local_metadata(), peer.agent_name) == ("ok", peer.agent_name)
    victim.assert_writes(peer, region, b"after-a-remembered-blob")
    (_, stats) = victim.ask("vetting")
    assert stats == {"starts": 2, "vetted": 1, "refused": 0, "deaths": 1, "remembered": 1}


def test_a_host_whose_blobs_killed_three_vetting_processes_is_refused_for_a_while(
        victim: Victim) -> None:
    """Guards against a hostile pod that kills a vetting process per request under a new
    agent name each time (names are bound to its host, not to a count): after three, its
    agents' new metadata is refused unvetted; a peer of another host still loads."""
    _wait_for_vetter(victim)
    for index in range(MAX_SOURCE_DEATHS):
        mallory, _ = victim.peer(name=f"mallory-{index}@10.66.0.9")
        answer = victim.add_peer(_corrupt(mallory.local_metadata(), mallory.agent_name,
                                          ADDRESS_VERSION, 0x7F), mallory.agent_name)
        assert "killed a vetting process (SIGABRT)" in answer[2], answer
    mallory, _ = victim.peer(name="mallory-new@10.66.0.9")
    answer = victim.add_peer(mallory.local_metadata(), mallory.agent_name)
    assert answer[:2] == ("error", "TransportError")
    assert (f"transport metadata of agent {mallory.agent_name!r} not loaded: blobs from "
            f"10.66.0.9 killed or stalled 3 vetting processes in the last 600 s; what its "
            f"agents bring new is refused for ") in answer[2], answer
    peer, region = victim.peer(name="decode-0@10.66.0.10")
    assert victim.add_peer(peer.local_metadata(), peer.agent_name) == ("ok", peer.agent_name)
    victim.assert_writes(peer, region, b"another-host")
    (_, stats) = victim.ask("vetting")
    assert stats["deaths"] == MAX_SOURCE_DEATHS and stats["vetted"] == 1


def test_a_vetting_process_that_cannot_start_refuses_every_blob_saying_so() -> None:
    """Fail closed: no vetting process, no load; the message names the cause and the fix."""
    vetter = MetadataVetter(VetterSpec("no-backend", nixl_agent.__module__, ("NOPE",), 0,
                                       tuple(os.environ.items())))
    metadata = NixlMetadata("decode-1", (("NOPE", b"\x02address"),), ())
    try:
        for _ in range(2):  # each blob tries a start again
            verdict = vetter.vet(metadata)
            assert verdict.outcome is VetOutcome.UNAVAILABLE
            assert "backends ['NOPE'] failed to load" in verdict.detail
        assert vetter.stats == VettingStats(starts=2)
        refusal = verdict.refusal("decode-1")
        assert refusal is not None and "set NixlConfig(vet_metadata=False)" in str(refusal)
    finally:
        vetter.close()
