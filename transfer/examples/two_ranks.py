"""One prefill rank and one decode rank, two processes on this machine, real NIXL.

The prefill process fills its KV pool, the decode process asks for a request's KV into
other (non-contiguous) pages; the parent checks the decode bytes and prints the result.

    .venv/bin/python transfer/examples/two_ranks.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import torch

from pd_transfer.endpoint import Endpoint, RankIdentity
from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.plan import Parallelism, RankCoord
from pd_transfer.kv.pool import KVPool
from pd_transfer.rank.opening import OpenRank, open_decode_rank, open_prefill_rank
from pd_transfer.transport.nixl import NixlTransport
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.trust.bootstrap import GeometryDoc

GEOMETRY = GeometryDoc(num_layers=4, total_kv_heads=2, head_dim=64, dtype="bfloat16",
                       page_size=16)
LAYOUT = KVLayout(num_layers=4, num_pages=32, page_size=16, kv_heads=2, head_dim=64,
                  dtype=torch.bfloat16)
ROOM, TOKENS = "request-1", 70
SRC_PAGES, DST_PAGES = [3, 4, 9, 20, 21], [30, 2, 11, 12, 7]


def rank(conn: Connection, role: str, auth: PeerAuth) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    pool = KVPool.allocate(LAYOUT)
    transport = NixlTransport(f"{role}-{uuid.uuid4().hex[:8]}")  # one name per incarnation
    identity = RankIdentity(f"{role}-0", RankCoord(0, 0), Parallelism(1), GEOMETRY)
    # Each opener publishes the rank's document (its memory registered) and starts its worker.
    rank: OpenRank[Endpoint[Any]]
    if role == "prefill":
        torch.manual_seed(0)
        for tensor in pool.tensors():
            tensor.copy_(torch.randn_like(tensor))
        prefill = open_prefill_rank(transport, pool, identity, auth=auth,
                                    staging_bytes=4 << 20, name="prefill")
        conn.send(prefill.bootstrap_address)
        prefill.endpoint.add_peer(conn.recv()).result(30)
        prefill.endpoint.register_request(ROOM, SRC_PAGES, TOKENS)
        prefill.endpoint.send_part(ROOM, last=True)
        rank = prefill
    else:
        decode = open_decode_rank(transport, pool, identity, auth=auth, ring_bytes=4 << 20,
                                  name="decode")
        conn.send(decode.bootstrap_address)
        decode.endpoint.add_peer(conn.recv()).result(30)
        decode.endpoint.expect(ROOM, DST_PAGES, TOKENS)
        rank = decode
    deadline = time.monotonic() + 30
    while (status := rank.endpoint.poll(ROOM)) is None or not status.finished:
        if time.monotonic() > deadline:
            break
        time.sleep(0.001)
    conn.send((status, pool.k.clone(), pool.v.clone()))  # type: ignore[union-attr]
    conn.recv()
    rank.close()


def tokens_of(tensor: torch.Tensor, pages: list[int]) -> torch.Tensor:
    slots = torch.tensor([p * 16 + t for p in pages for t in range(16)])[:TOKENS]
    return tensor[:, slots]


def main() -> None:
    ctx = mp.get_context("spawn")
    pipes = {role: ctx.Pipe() for role in ("prefill", "decode")}
    auth = PeerAuth.generate()  # in a pod: PeerAuth.from_file($PD_TRANSFER_AUTH_KEY_FILE)
    procs = [ctx.Process(target=rank, args=(pipes[r][1], r, auth)) for r in pipes]
    for proc in procs:
        proc.start()
    addresses = {role: pipes[role][0].recv() for role in pipes}
    pipes["prefill"][0].send(addresses["decode"])
    pipes["decode"][0].send(addresses["prefill"])
    (p_status, p_k, p_v), (d_status, d_k, d_v) = (pipes[r][0].recv() for r in pipes)
    for role in pipes:
        pipes[role][0].send("bye")
    for proc in procs:
        proc.join(30)
    same = all(torch.equal(tokens_of(src, SRC_PAGES), tokens_of(dst, DST_PAGES))
               for src, dst in ((p_k, d_k), (p_v, d_v)))
    print(f"prefill: {p_status.state.value}, decode: {d_status.state.value}, "
          f"{d_status.bytes_transferred} bytes in {d_status.duration_s * 1e3:.1f} ms, "
          f"bit-exact: {same}")
    raise SystemExit(0 if same and d_status.state.value == "Succeeded" else 1)


if __name__ == "__main__":
    main()
