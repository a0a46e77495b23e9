"""Authenticated peers (docs/failure-modes.md #26): the transfer key file, the HMAC frames,
signed bootstrap documents, the NIXL metadata checks, and the endpoints' counted rejections.

Loopback endpoints stepped by hand (``pd_testbed.transfer_harness``); no NIXL process is started.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import pickle
import struct
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pd_testbed.transfer_harness import TEST_AUTH, Cluster, Request, seal_as
from pd_transfer.decode import DecodeReceiver
from pd_transfer.errors import BootstrapError, TransportError
from pd_transfer.protocol.lifecycle import State
from pd_transfer.protocol.messages import PROTOCOL_VERSION, Release, RingUpdate, encode_message
from pd_transfer.reference.engine.errors import EngineConfigError
from pd_transfer.reference.engine.main import load_auth
from pd_transfer.transport import LoopbackTransport, Transport
from pd_transfer.transport.nixl_metadata import parse_nixl_metadata
from pd_transfer.trust.auth import (
    FRAME_MAGIC,
    SECRET_MAGIC,
    AuthKeyError,
    PeerAuth,
    Purpose,
    Unauthenticated,
)
from pd_transfer.trust.bootstrap import (
    DOCUMENT_VERSION,
    agent_host,
    bound_agent_name,
    open_document,
    seal_document,
)

pytestmark = pytest.mark.timeout(60)

KEY_A, KEY_B, KEY_C = b"\xab" * 32, b"\x22" * 32, b"\x3c" * 32
HINT = "expected 64 lowercase hex characters"


# Key file ------------------------------------------------------------------------------------


def test_key_file_with_current_and_previous_keys_parses_in_order() -> None:
    """The first line signs, later lines verify (rotation): the order must be kept."""
    auth = PeerAuth.parse(f"{KEY_A.hex()}\n{KEY_B.hex()}\n")
    assert auth.key_file_text() == f"{KEY_A.hex()}\n{KEY_B.hex()}\n"
    frame = auth.seal(b"x", purpose=Purpose.MESSAGE, version=1, sender="a", receiver="b")
    assert frame[4:36] == hmac.new(KEY_A, frame_context("message", 1, "a", "b") + b"x",
                                   hashlib.sha256).digest()


def test_key_file_without_final_newline_is_accepted() -> None:
    assert PeerAuth.parse(KEY_A.hex()).key_file_text() == KEY_A.hex() + "\n"


@pytest.mark.parametrize(("text", "message"), [
    ("", "is empty: " + HINT),
    ("\n", "line 1: " + HINT + r".*got 0 characters"),
    (KEY_A.hex().upper() + "\n", "line 1: " + HINT + r".*got 64 characters"),
    (KEY_A.hex()[:-2] + "\n", "line 1: " + HINT + r".*got 62 characters"),
    (f"{KEY_A.hex()}\n {KEY_B.hex()}\n", "line 2: " + HINT + r".*got 65 characters"),
    (f"{KEY_A.hex()}\r\n", "line 1: " + HINT + r".*got 65 characters"),
    (f"{KEY_A.hex()}\n\n{KEY_B.hex()}\n", "line 2: " + HINT),
    (f"{KEY_A.hex()}\n{KEY_B.hex()}\n{KEY_A.hex()}\n", "line 3 repeats line 1"),
    ("".join(f"{(bytes([i]) * 32).hex()}\n" for i in range(1, 6)),
     "has 5 lines; at most 4 keys"),
])
def test_malformed_key_files_are_refused_naming_the_line_and_format(
        text: str, message: str) -> None:
    """A pod with a broken key must not start and must say which line is wrong and what is
    expected (docs/failure-modes.md #26), without echoing the key."""
    with pytest.raises(AuthKeyError, match=message) as caught:
        PeerAuth.parse(text, "key.txt")
    assert str(caught.value).startswith("key.txt")
    assert KEY_A.hex() not in str(caught.value)


def test_engine_refuses_to_start_without_a_readable_key(tmp_path: Path) -> None:
    """An engine without the deployment's key could talk to nobody (or to anybody)."""
    with pytest.raises(EngineConfigError, match="PD_TRANSFER_AUTH_KEY_FILE is not set"):
        load_auth({})
    missing = tmp_path / "absent.key"
    with pytest.raises(EngineConfigError, match=r"cannot read the transfer key file .*absent"):
        load_auth({"PD_TRANSFER_AUTH_KEY_FILE": str(missing)})
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(EngineConfigError, match="is not UTF-8 text"):
        load_auth({"PD_TRANSFER_AUTH_KEY_FILE": str(bad)})
    good = tmp_path / "good.key"
    good.write_text(f"{KEY_B.hex()}\n{KEY_A.hex()}\n")
    auth = load_auth({"PD_TRANSFER_AUTH_KEY_FILE": str(good)})
    assert auth.key_file_text() == good.read_text()


# Frames ---------------------------------------------------------------------------------------


def frame_context(purpose: str, version: int, sender: str, receiver: str) -> bytes:
    """The MAC's context, derived by hand from auth.py's docstring."""
    fields = (purpose.encode(), str(version).encode(), sender.encode(), receiver.encode())
    return b"pd-transfer/auth/1\x00" + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _seal(auth: PeerAuth, body: bytes = b"body", *, sender: str = "p", receiver: str = "d",
          version: int = PROTOCOL_VERSION, purpose: Purpose = Purpose.MESSAGE) -> bytes:
    return auth.seal(body, purpose=purpose, version=version, sender=sender, receiver=receiver)


def _open(auth: PeerAuth, frame: bytes, *, sender: str = "p", receiver: str = "d",
          version: int = PROTOCOL_VERSION, purpose: Purpose = Purpose.MESSAGE) -> bytes:
    return auth.open(frame, purpose=purpose, version=version, sender=sender, receiver=receiver)


def test_a_frame_is_magic_mac_body() -> None:
    frame = _seal(PeerAuth([KEY_A]))
    mac = hmac.new(KEY_A, frame_context("message", PROTOCOL_VERSION, "p", "d") + b"body",
                   hashlib.sha256).digest()
    assert frame == FRAME_MAGIC + mac + b"body"


def test_mac_verifies_with_the_current_and_with_a_previous_key() -> None:
    """During a rotation pods hold [new, old] or [old]: each must accept the other."""
    rotated, old = PeerAuth([KEY_B, KEY_A]), PeerAuth([KEY_A])
    assert _open(rotated, _seal(old)) == b"body"  # a pod not yet rotated → a rotated one
    assert _open(rotated, _seal(rotated)) == b"body"
    with pytest.raises(Unauthenticated, match="matches none of the 1 accepted keys"):
        _open(old, _seal(rotated))  # signed with KEY_B, which the old pod does not know
    with pytest.raises(Unauthenticated, match="matches none of the 2 accepted keys"):
        _open(rotated, _seal(PeerAuth([KEY_C])))


@pytest.mark.parametrize(("change", "kwargs"), [
    ("reflected back to its sender", {"sender": "d", "receiver": "p"}),
    ("re-aimed at another receiver", {"receiver": "d2"}),
    ("claimed by another sender", {"sender": "p2"}),
    ("replayed under another protocol version", {"version": PROTOCOL_VERSION + 1}),
    ("a message used as a document", {"purpose": Purpose.DOCUMENT}),
])
def test_a_frame_is_bound_to_its_sender_receiver_version_and_purpose(
        change: str, kwargs: dict[str, object]) -> None:
    """docs/failure-modes.md #26: a valid frame must not be usable anywhere else."""
    frame = _seal(TEST_AUTH)
    with pytest.raises(Unauthenticated) as caught:
        _open(TEST_AUTH, frame, **kwargs)  # type: ignore[arg-type]
    assert caught.value.reason == "unauthenticated", change


@pytest.mark.parametrize("frame", [
    b"", b"PDA1",
    encode_message(Release(room="r", ticket=1)),  # unframed JSON: an older or foreign peer
    FRAME_MAGIC + b"\x00" * 32 + b"body",
])
def test_unframed_or_forged_frames_are_unauthenticated(frame: bytes) -> None:
    with pytest.raises(Unauthenticated):
        _open(TEST_AUTH, frame)


def test_a_flipped_body_bit_is_unauthenticated() -> None:
    frame = bytearray(_seal(TEST_AUTH, b'{"v":3}'))
    frame[-2] ^= 1
    with pytest.raises(Unauthenticated):
        _open(TEST_AUTH, bytes(frame))


# Encrypted frames (documents and ring announcements: docs/failure-modes.md #47) -------------


def _secret(auth: PeerAuth, body: bytes = b"secret body", **kwargs: object) -> bytes:
    fields: dict[str, object] = {"purpose": Purpose.MESSAGE, "version": PROTOCOL_VERSION,
                                 "sender": "p", "receiver": "d", **kwargs}
    return auth.seal(body, confidential=True, **fields)  # type: ignore[arg-type]


def test_an_encrypted_frame_is_magic_nonce_and_aes_gcm_under_a_derived_key() -> None:
    """Decrypted here by hand from auth.py's docstring: the key is HMAC-SHA256(key,
    "pd-transfer/encrypt/1"), the context is the associated data."""
    frame = _secret(PeerAuth([KEY_A]))
    assert frame.startswith(SECRET_MAGIC) and b"secret" not in frame
    key = hmac.new(KEY_A, b"pd-transfer/encrypt/1", hashlib.sha256).digest()
    nonce, sealed = frame[4:16], frame[16:]
    context = frame_context("message", PROTOCOL_VERSION, "p", "d")
    assert AESGCM(key).decrypt(nonce, sealed, context) == b"secret body"
    assert _secret(PeerAuth([KEY_A]))[4:16] != nonce  # a fresh nonce per frame


def test_an_encrypted_frame_opens_only_in_its_context_and_with_an_accepted_key() -> None:
    frame = _secret(TEST_AUTH)
    assert _open(TEST_AUTH, frame) == b"secret body"
    for change in ({"receiver": "d2"}, {"sender": "d"}, {"purpose": Purpose.DOCUMENT},
                   {"version": PROTOCOL_VERSION + 1}):
        with pytest.raises(Unauthenticated, match="no accepted key decrypts it"):
            _open(TEST_AUTH, frame, **change)  # type: ignore[arg-type]
    tampered = bytearray(frame)
    tampered[-20] ^= 1
    with pytest.raises(Unauthenticated):
        _open(TEST_AUTH, bytes(tampered))
    with pytest.raises(Unauthenticated, match="shorter than an encrypted frame"):
        _open(TEST_AUTH, frame[:30])
    rotated, old = PeerAuth([KEY_B, KEY_A]), PeerAuth([KEY_A])
    assert _open(rotated, _secret(old)) == b"secret body"  # rotation, both ways
    assert _open(rotated, _secret(rotated)) == b"secret body"
    with pytest.raises(Unauthenticated):
        _open(old, _secret(rotated))


def test_what_must_be_encrypted_is_refused_in_a_frame_that_is_only_maced() -> None:
    with pytest.raises(Unauthenticated, match="accepted encrypted only"):
        TEST_AUTH.open(_seal(TEST_AUTH), purpose=Purpose.MESSAGE, version=PROTOCOL_VERSION,
                       sender="p", receiver="d", confidential=True)


def test_a_key_set_survives_pickling_for_a_spawned_process() -> None:
    copy = pickle.loads(pickle.dumps(PeerAuth([KEY_A, KEY_B])))
    assert _open(copy, _secret(PeerAuth([KEY_A]))) == b"secret body"
    assert _open(PeerAuth([KEY_A]), _secret(copy)) == b"secret body"  # KEY_A in force


def test_a_ring_update_travels_encrypted_and_a_plaintext_one_is_refused() -> None:
    cluster = Cluster()
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    update = receiver._ring_update()
    sealed = receiver.seal(sender.transport.agent_name, update)
    assert sealed.startswith(SECRET_MAGIC) and update.transport_metadata_b64.encode() not in sealed
    plain = TEST_AUTH.seal(encode_message(update), purpose=Purpose.MESSAGE,
                           version=PROTOCOL_VERSION, sender=receiver.transport.agent_name,
                           receiver=sender.transport.agent_name)
    receiver.transport.send_message(sender.transport.agent_name, plain)
    cluster.step()
    assert sender.metrics.snapshot().rejected_by_reason == {"plaintext_secret": 1}


# Agent names bound to their pod (docs/failure-modes.md #48) ---------------------------------


def test_an_agent_name_is_bound_to_a_host_peers_reach_its_pod_at() -> None:
    assert bound_agent_name("vllm-decode-r0-pod-1a2b", "10.1.2.3") == (
        "vllm-decode-r0-pod-1a2b@10.1.2.3")
    assert agent_host("vllm-decode-r0-pod-1a2b@10.1.2.3") == "10.1.2.3"
    assert agent_host("fd00::1@x@fd00::2") == "fd00::2"
    assert agent_host("unbound-name") == ""
    for base, host in (("a@b", "10.0.0.1"), ("has space", "10.0.0.1"), ("", "10.0.0.1")):
        with pytest.raises(ValueError, match="agent name base"):
            bound_agent_name(base, host)
    for host in ("0.0.0.0", "::", "", "10.0.0.1/24"):
        with pytest.raises(ValueError, match="agent host"):
            bound_agent_name("decode", host)


# Bootstrap documents --------------------------------------------------------------------------


def test_documents_are_verified_before_they_are_parsed() -> None:
    """A document from outside the deployment never reaches pydantic or the transport, and
    one that is only MACed (version 2 and 3 style: readable by anyone who GETs it) is refused
    (docs/failure-modes.md #47)."""
    cluster = Cluster()
    document = cluster.receivers[0].document()
    sealed = seal_document(document, TEST_AUTH)
    assert open_document(sealed, TEST_AUTH, "d:1") == document
    assert document.v == DOCUMENT_VERSION == 5
    assert sealed.startswith(SECRET_MAGIC)
    assert document.agent_name.encode() not in sealed
    assert document.transport_metadata_b64.encode()[:16] not in sealed
    with pytest.raises(BootstrapError, match="d:1: unauthenticated bootstrap document"):
        open_document(seal_document(document, PeerAuth([KEY_C])), TEST_AUTH, "d:1")
    with pytest.raises(BootstrapError, match="unauthenticated"):
        open_document(document.model_dump_json().encode(), TEST_AUTH, "d:1")  # version 1 style
    only_maced = TEST_AUTH.seal(document.model_dump_json().encode(), purpose=Purpose.DOCUMENT,
                                version=DOCUMENT_VERSION, sender="", receiver="")
    with pytest.raises(BootstrapError, match="accepted encrypted only"):
        open_document(only_maced, TEST_AUTH, "d:1")
    not_json = TEST_AUTH.seal(b"[" * 5000, purpose=Purpose.DOCUMENT, version=DOCUMENT_VERSION,
                              sender="", receiver="", confidential=True)
    with pytest.raises(BootstrapError, match="not a JSON object"):
        open_document(not_json, TEST_AUTH, "d:1")


# NIXL metadata checks (the format is in transport/nixl_metadata.py) -------------------------


def _record(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value + b"|"


# A UCX remote key as UCP packs it: MD map 1, host memory, one empty transport key, no device.
UCX_KEY = struct.pack("<QBBB", 1, 0, 0, 0xFF)


def nixl_blob(name: bytes = b"decode-1", conn: bytes = b"\x05ucx-address",
              descs: int = 1, kind: int = 0) -> bytes:
    """A blob laid out as nixl 1.5.1's ``get_agent_metadata`` lays it out."""
    blob = b"nixlSerDes|" + _record(b"Agent", name) + _record(b"Conns", struct.pack("<Q", 1))
    blob += _record(b"t", b"UCX") + _record(b"c", conn) + _record(b"", b"MemSection")
    blob += _record(b"nixlSecElms", struct.pack("<Q", 1)) + _record(b"bknd", b"UCX")
    blob += _record(b"nixlDList", b"nixlSDList") + _record(b"t", struct.pack("<I", kind))
    blob += _record(b"n", struct.pack("<Q", descs))
    for i in range(descs):
        blob += _record(b"", struct.pack("<QQQ", 0x1000 * (i + 1), 4096, 0) + UCX_KEY)
    return blob


def test_well_formed_metadata_is_read_completely() -> None:
    metadata = parse_nixl_metadata(nixl_blob(descs=2), "decode-1")
    assert metadata.agent_name == "decode-1"
    assert metadata.connections == (("UCX", b"\x05ucx-address"),)
    assert metadata.backend_keys() == {("UCX", "DRAM", 0x1000, 4096, 0): UCX_KEY,
                                       ("UCX", "DRAM", 0x2000, 4096, 0): UCX_KEY}


@pytest.mark.parametrize(("blob", "message"), [
    (nixl_blob(name=b"decode-2"), "names agent 'decode-2' but its authenticated sender is "
                                  "'decode-1'"),
    (nixl_blob()[:-1] + b"#", r"record b'' at byte 213 lacks its '\|' terminator"),
    (nixl_blob()[:-1], r"record b'' at byte 213 claims 35 bytes \(at most 4096, 34 left\)"),
    (nixl_blob() + b"\x00", "1 bytes follow the last memory section"),
    (nixl_blob(kind=7), r"memory type 07000000 \(only DRAM 0 and VRAM 1"),
    (nixl_blob(name=b"decode 1"), "is not printable ASCII"),
    (nixl_blob().replace(b"Conns\x08", b"Conns\x09"), "claims 9 bytes"),
    (nixl_blob().replace(b"nixlSerDes|", b"nixlSerDeZ|"), "does not start with"),
    (b"nixlSerDes|", "11 bytes; expected more than 11"),
    (nixl_blob()[:40], r"record b'Conns' at byte 33 is cut short"),
])
def test_malformed_or_misnamed_metadata_is_refused_before_nixl(blob: bytes,
                                                               message: str) -> None:
    """UCX aborts on some malformed blobs, and a blob naming another agent would register it
    under the victim's name (docs/failure-modes.md #26): both refused by pure checks."""
    with pytest.raises(TransportError, match=message):
        parse_nixl_metadata(blob, "decode-1")


# Endpoints: counted rejections, no state change ----------------------------------------------


def test_unauthenticated_messages_are_counted_and_never_acted_on() -> None:
    """A Release for a live request from a peer without the key (or aimed at another peer)
    would end it: it must be counted ``unauthenticated`` and dropped (#26)."""
    cluster = Cluster()
    receiver, sender = cluster.receivers[0], cluster.senders[0]
    request = cluster.new_request(num_tokens=8)
    cluster.start(request, send=False)
    cluster.run(lambda: sender.poll(request.room).state is State.TRANSFERRING)  # type: ignore[union-attr]
    sender_name, receiver_name = sender.transport.agent_name, receiver.transport.agent_name
    release = Release(room=request.room, ticket=receiver.request_tickets(request.room)[sender_name])
    stranger = PeerAuth([KEY_C])
    for payload in (
        encode_message(release),  # unframed
        seal_as(receiver_name, sender_name, release, stranger),  # another deployment's key
        seal_as(receiver_name, "prefill-9-9", release),  # meant for another agent
        seal_as(sender_name, receiver_name, release),  # our own message reflected back
    ):
        receiver.transport.send_message(sender_name, payload)
    cluster.step()
    assert sender.metrics.snapshot().rejected_by_reason == {"unauthenticated": 4}
    assert sender.poll(request.room).state is State.TRANSFERRING  # type: ignore[union-attr]
    sender.send_part(request.room, last=True)
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == {State.SUCCEEDED} and cluster.verified(request)


def _ring_update(metadata: bytes, version: int = 2) -> RingUpdate:
    return RingUpdate(ring_version=version, name="ring", base_address=0x1000, size_bytes=4096,
                      kind="DRAM", device_id=0,
                      transport_metadata_b64=base64.b64encode(metadata).decode())


def _other_incarnation(metadata: bytes) -> bytes:
    """Loopback metadata (magic, incarnation, NUL, name) naming the same agent as a dead
    incarnation: loading it would make every send to that agent fail PeerUnreachable."""
    magic_end = metadata.index(b"\x00") + 1
    return metadata[:magic_end] + b"77" + metadata[metadata.index(b"\x00", magic_end):]


def _victim_in_flight() -> tuple[Cluster, Request, DecodeReceiver, DecodeReceiver]:
    """One prefill rank, decode ranks "mallory" and its victim, one request in flight to both."""
    cluster = Cluster(decode_tp=2)
    mallory, victim = cluster.receivers
    request = cluster.new_request(num_tokens=8)
    cluster.start(request)
    return cluster, request, mallory, victim


def _loaded(transport: Transport) -> dict[str, int]:
    """What the loopback transport has loaded: agent name → incarnation."""
    assert isinstance(transport, LoopbackTransport)
    return dict(transport._peers)


def _assert_finishes_bit_exactly(cluster: Cluster, request: Request) -> None:
    cluster.run(lambda: cluster.finished(request.room))
    assert cluster.states(request.room) == {State.SUCCEEDED} and cluster.verified(request)


def test_a_ring_update_naming_another_agent_changes_no_transport_state() -> None:
    """docs/failure-modes.md #26: an authenticated decode peer sends a
    RingUpdate carrying the victim's metadata; before, the sender loaded it (evicting or
    re-registering the victim) and only then compared names. Now nothing changes: the
    victim's connection and request finish bit-exactly."""
    cluster, request, mallory, victim = _victim_in_flight()
    sender = cluster.senders[0]
    loaded_before = _loaded(sender.transport)
    peers_before = dict(sender.peers)
    forged = _ring_update(_other_incarnation(victim.transport.local_metadata()))
    mallory_name = mallory.transport.agent_name
    sender_name = sender.transport.agent_name
    mallory.transport.send_message(sender_name, seal_as(mallory_name, sender_name, forged))
    cluster.step()
    assert sender.metrics.snapshot().rejected_by_reason == {"invalid_ring_update": 1}
    assert _loaded(sender.transport) == loaded_before
    assert sender.peers == peers_before
    _assert_finishes_bit_exactly(cluster, request)


def test_a_second_document_for_a_connected_agent_replaces_nothing() -> None:
    """A connected peer's entry changes only through its own authenticated RingUpdate (#26)."""
    cluster = Cluster()
    sender, receiver = cluster.senders[0], cluster.receivers[0]
    before = sender.peers[receiver.transport.agent_name]
    forged = before.model_copy(update={"ring_version": 99, "num_pages": 1})
    future = sender.add_peer_document(forged)
    cluster.step()
    assert future.result() == receiver.transport.agent_name
    assert sender.peers[receiver.transport.agent_name] == before


def test_a_document_naming_another_agents_metadata_changes_no_transport_state() -> None:
    """docs/failure-modes.md #26: a document for a new agent whose metadata
    names a connected victim. Before, ``_connect`` loaded it (replacing the victim's entry)
    and then removed the victim; now it is refused before the transport sees it."""
    cluster, request, mallory, victim = _victim_in_flight()
    sender = cluster.senders[0]
    loaded_before = _loaded(sender.transport)
    forged = mallory.document().model_copy(update={
        "agent_name": "mallory-2",
        "transport_metadata_b64": base64.b64encode(
            _other_incarnation(victim.transport.local_metadata())).decode()})
    future = sender.add_peer_document(forged)
    cluster.step()
    with pytest.raises(TransportError, match="names agent 'decode-0-1' but its authenticated "
                                             "sender is 'mallory-2'"):
        future.result()
    assert _loaded(sender.transport) == loaded_before
    assert "mallory-2" not in sender.peers
    _assert_finishes_bit_exactly(cluster, request)


def test_a_rotated_key_file_is_picked_up_without_a_restart(tmp_path: Path) -> None:
    """Guards against a rotation that needs pod restarts (docs/failure-modes.md #26): the
    operator writes the new key first and keeps the old one second; a pod that still holds
    only the old key verifies a frame signed with the new one by re-reading its file, and
    signs with the new key from then on."""
    old, new = "a" * 64, "b" * 64
    path = tmp_path / "transfer.key"
    path.write_text(f"{old}\n")
    stale = PeerAuth.from_file(path)
    rotated = PeerAuth.parse(f"{new}\n{old}\n")
    frame = rotated.seal(b"body", purpose=Purpose.MESSAGE, version=3, sender="p", receiver="d")
    path.unlink()  # the kubelet swaps the file, as it does for a Secret volume
    path.write_text(f"{new}\n{old}\n")
    assert stale.open(frame, purpose=Purpose.MESSAGE, version=3, sender="p",
                      receiver="d") == b"body"
    assert stale.fingerprint == rotated.fingerprint
    # A malformed file later keeps the keys in force.
    path.unlink()
    path.write_text("not a key\n")
    assert stale.refresh(min_interval_s=0.0) is False
    assert stale.fingerprint == rotated.fingerprint
