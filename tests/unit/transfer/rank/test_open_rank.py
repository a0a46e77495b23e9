"""``open_prefill_rank`` / ``open_decode_rank``: one wiring of a rank (endpoint, bootstrap
server, worker) for every engine, typed by role, opened all or nothing and closed in order.
Real bootstrap servers on loopback sockets, the loopback transport (no NIXL needed: what is
checked is the wiring, not the data path)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from pd_contract.transferagent import Role
from pd_testbed.transfer_harness import TEST_AUTH
from pd_transfer.decode import DecodeReceiver
from pd_transfer.endpoint import Endpoint, RankIdentity
from pd_transfer.errors import TransportError
from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.plan import Parallelism, RankCoord
from pd_transfer.kv.pool import KVPool
from pd_transfer.prefill import PrefillSender
from pd_transfer.rank.opening import OpenRank, RankOptions, open_decode_rank, open_prefill_rank
from pd_transfer.transport import LoopbackFabric
from pd_transfer.transport.base import Transport
from pd_transfer.trust.bootstrap import DTYPES, GeometryDoc, fetch_document

pytestmark = pytest.mark.timeout(30)

GEOMETRY = GeometryDoc(num_layers=2, total_kv_heads=2, head_dim=4, dtype="bfloat16",
                       page_size=4)


def _pool() -> KVPool:
    return KVPool.allocate(KVLayout(2, 16, 4, 2, 4, DTYPES["bfloat16"]))


def _identity(instance: str) -> RankIdentity:
    return RankIdentity(instance, RankCoord(0, 0), Parallelism(1), GEOMETRY)


def _open_prefill(transport: Transport, options: RankOptions) -> OpenRank[PrefillSender]:
    return open_prefill_rank(transport, _pool(), _identity("i0"), auth=TEST_AUTH,
                             staging_bytes=8192, name="test-prefill", options=options)


def _open_decode(transport: Transport, options: RankOptions) -> OpenRank[DecodeReceiver]:
    return open_decode_rank(transport, _pool(), _identity("i0"), auth=TEST_AUTH,
                            ring_bytes=8192, name="test-decode", options=options,
                            mode="staged", pregrant_share=0.0)


Opener = Callable[[Transport, RankOptions], OpenRank[Endpoint[Any]]]


@pytest.mark.parametrize(("role", "opener", "kind", "size_of"), [
    (Role.PREFILL, _open_prefill, PrefillSender, lambda e: e.staging.capacity_bytes),
    (Role.DECODE, _open_decode, DecodeReceiver, lambda e: e.ring.capacity_bytes),
])
def test_a_rank_opens_serves_its_document_and_closes_in_order(
        role: Role, opener: Opener, kind: type, size_of: Callable[[Any], int]) -> None:
    fabric = LoopbackFabric()
    transport = fabric.create(f"{role.value}-0@127.0.0.1")
    rank = opener(transport, RankOptions())
    try:
        assert type(rank.endpoint) is kind and size_of(rank.endpoint) == 8192
        assert rank.worker.alive and rank.worker.endpoint is rank.endpoint
        document = fetch_document(rank.bootstrap_address, 5.0, TEST_AUTH)
        assert (document.role, document.instance, document.agent_name) == (
            role.value, "i0", f"{role.value}-0@127.0.0.1")
    finally:
        rank.close()
    assert not rank.worker.alive
    with pytest.raises(TransportError, match="closed"):  # the worker closed the endpoint
        transport.local_metadata()
    with pytest.raises(urllib.error.URLError):  # and nothing serves the document any more
        urllib.request.urlopen(f"http://{rank.bootstrap_address}/", timeout=2)


def test_a_rank_whose_bootstrap_port_is_taken_opens_nothing() -> None:
    """All or nothing: the endpoint built before the server failed is closed again (its
    transport with it), and the error reaches the caller."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fabric = LoopbackFabric()
        transport = fabric.create("decode-0")
        with pytest.raises(OSError):
            _open_decode(transport, RankOptions(port=port))
    with pytest.raises(TransportError, match="closed"):
        transport.local_metadata()


def test_a_decode_rank_takes_its_own_options() -> None:
    """What only decode has (the default path, the pre-grant share) is its opener's."""
    rank = _open_decode(LoopbackFabric().create("decode-0@127.0.0.1"), RankOptions())
    try:
        assert (rank.endpoint.mode, rank.endpoint.pregrant_share) == ("staged", 0.0)
    finally:
        rank.close()
