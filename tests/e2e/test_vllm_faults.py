"""Real vLLM (CPU backend) with PDTransferConnector under faults: pods killed mid-transfer,
peers that never come, clients that leave, and 200 such requests in a row.

Six vLLM servers as real processes on one host: a single instance (the reference, the
session's `tiny_llama`: tests/e2e/conftest.py), a prefill, two decodes that differ only in
vLLM's ``kv_load_failure_policy`` (``fail`` and ``recompute``), and a prefill and a decode
that a test kills with SIGKILL mid-transfer.
Short transfer timeouts (``TIMEOUTS``) keep each fault's wait bounded.

What "nothing left" means, read from outside the engines: vLLM's own
``vllm:kv_cache_usage_perc`` back to 0.0 (prefix caching is off, so every block is free
again) and no request running or waiting; the pod agent's
``pd_transfer_connector_live_requests`` at 0 for the scheduler and every rank.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from pd_testbed.polling import wait_for
from pd_testbed.vllm import (
    CHUNK_TOKENS,
    SERVED_MODEL_NAME,
    TINY_LLAMA,
    CompletionResult,
    PdTransferServer,
    ServedModel,
    VllmServer,
    complete,
    free_ports,
    greedy_disagreement,
    pd_transfer_request,
    pd_transfer_server,
    prompt_ids,
    running,
    scrape,
    vllm_metric,
)

# The first test's setup starts several vLLM engines (and, first in a session, the shared
# reference engine: tests/e2e/conftest.py), half a minute to several minutes each on 2 loaded cores.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = TINY_LLAMA
BATCH_TOKENS = CHUNK_TOKENS
MAX_TOKENS = 6
# Decode's transfer deadline runs from its RequestKV, so it also covers the prefill
# engine's queue (prefill keeps an early RequestKV that long too): at 12 requests in
# flight on a slow 2-core host, 4 s failed plain requests (6 answered 500 in one run;
# 4 TransferTimeouts in the next), and 8 s with a 6 s early wait failed 3 of 33.
TRANSFER_S = 10.0
LEASE_S = 6.0
TIMEOUTS = {"transfer_seconds": TRANSFER_S, "kv_lease_seconds": LEASE_S,
            "bootstrap_seconds": 2.0, "grant_seconds": 1.0}
LONG = 1500  # 6 chunks of 256 tokens: the transfer spans the whole prefill


@dataclass
class Fleet:
    single: VllmServer
    prefill: PdTransferServer
    decode_fail: PdTransferServer
    decode_recompute: PdTransferServer
    prefill_victim: PdTransferServer
    decode_victim: PdTransferServer

    def pd(self, prefill: PdTransferServer, decode: PdTransferServer, prompt: list[int],
           room: str | None = None, *, timeout_s: float = 120.0,
           prefill_must_answer: bool = True) -> CompletionResult:
        return pd_transfer_request(prompt, MAX_TOKENS, room=room or uuid.uuid4().hex,
                                   prefill=prefill.bootstrap, decode=decode.bootstrap,
                                   prefill_server=prefill.server, decode_server=decode.server,
                                   timeout_s=timeout_s, prefill_must_answer=prefill_must_answer)

    def expected(self, prompt: list[int]) -> list[int]:
        return self.reference(prompt).token_ids

    def reference(self, prompt: list[int]) -> CompletionResult:
        """The single instance's greedy completion, with its top two tokens' logprobs per
        step (what `greedy_disagreement` reads)."""
        return complete(self.single, prompt, MAX_TOKENS, top_logprobs=2)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_llama: ServedModel) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("vllm-faults")
    options: dict[str, Any] = {"max_num_batched_tokens": BATCH_TOKENS, "timeouts": TIMEOUTS}

    def server(role: str, name: str, policy: str | None = None) -> PdTransferServer:
        return pd_transfer_server(tiny_llama.vllm, MODEL, tiny_llama.model_dir, root, role,
                                  name=name, failure_policy=policy, **options)

    fleet = Fleet(
        single=tiny_llama.single,
        prefill=server("prefill", "prefill"),
        decode_fail=server("decode", "decode-fail", "fail"),
        decode_recompute=server("decode", "decode-recompute", "recompute"),
        prefill_victim=server("prefill", "prefill-victim"),
        decode_victim=server("decode", "decode-victim"),
    )
    servers = [s.server for s in (fleet.prefill, fleet.decode_fail, fleet.decode_recompute,
                                  fleet.prefill_victim, fleet.decode_victim)]
    with running(servers):
        yield fleet


def events(server: PdTransferServer, room: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in server.timeline() if e["event"] == kind and room in e["rooms"]]


def drained(server: PdTransferServer) -> dict[str, float | None]:
    """What is still held: vLLM's KV usage and queues, the connector's live requests."""
    return {
        "kv_cache_usage": vllm_metric(server.server, "vllm:kv_cache_usage_perc"),
        "running": vllm_metric(server.server, "vllm:num_requests_running"),
        "waiting": vllm_metric(server.server, "vllm:num_requests_waiting"),
        "scheduler_live": server.metric("pd_transfer_connector_live_requests",
                                        side="scheduler"),
        "rank0_live": server.metric("pd_transfer_connector_live_requests", side="rank",
                                    rank="0"),
    }


IDLE = {"kv_cache_usage": 0.0, "running": 0.0, "waiting": 0.0, "scheduler_live": 0.0,
        "rank0_live": 0.0}


def assert_drains(server: PdTransferServer, timeout_s: float) -> float:
    """Wait until ``server`` holds nothing (``IDLE``); return how long it took. A timeout
    fails the test with what was still held."""
    started = time.monotonic()
    last: dict[str, float | None] = {}

    def idle() -> bool:
        nonlocal last
        last = drained(server)
        return last == IDLE

    try:
        wait_for(f"{server.name} to drain", idle, timeout_s, interval_s=0.2)
    except pytest.fail.Exception:
        pytest.fail(f"{server.name} still holds {last} after {timeout_s} s")
    return time.monotonic() - started


def test_decode_killed_mid_transfer_prefill_frees_within_its_timeout(fleet: Fleet) -> None:
    assert drained(fleet.prefill) == IDLE
    warm = prompt_ids(64, seed=10)  # the pods connect once; later requests start at once
    assert fleet.pd(fleet.prefill, fleet.decode_victim, warm).token_ids == fleet.expected(warm)
    room = "decode-dies-" + uuid.uuid4().hex
    prompt = prompt_ids(LONG, seed=11)
    with ThreadPoolExecutor(max_workers=1) as pool:
        request = pool.submit(fleet.pd, fleet.prefill, fleet.decode_victim, prompt, room)
        # Mid-transfer: prefill holds the prompt's KV (its parts posted) and decode has
        # started its load. On this host the 3 MB move in milliseconds, so decode is frozen
        # first (SIGSTOP: whatever prefill writes now meets a peer that no longer answers)
        # and killed after.
        wait_for("decode started its load and prefill posted",
                 lambda: events(fleet.decode_victim, room, "load_start")
                 and events(fleet.prefill, room, "post"), timeout_s=60, interval_s=0.002)
        fleet.decode_victim.server.freeze()
        time.sleep(0.5)
        fleet.decode_victim.server.kill()
        killed = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 -- decode's connection dies with it
            request.result(timeout=60)
    (end,) = wait_for("prefill ended the transfer", lambda: events(fleet.prefill, room, "end"),
                      timeout_s=LEASE_S + 5)
    # Decode's RequestKV either reached prefill (the transfer then times out or its writes
    # fail), or died with decode (prefill's KV lease runs out), or prefill found decode gone
    # first (a notification meets the closed connection, or the re-check of decode's
    # documents gets no answer): each frees the KV.
    assert end["state"] == "Failed"
    assert end["reason"] in {"TransferTimeout", "TransportFailed", "LeaseExpired",
                             "PeerUnreachable"}, end
    assert_drains(fleet.prefill, LEASE_S + 5)
    assert time.monotonic() - killed <= LEASE_S + 5
    print(f"decode killed: prefill ended the transfer {end['reason']} after "
          f"{end['duration_s']:.2f} s with {end['bytes']} bytes written; drained "
          f"{time.monotonic() - killed:.2f} s after the kill")
    # Prefill keeps serving.
    prompt = prompt_ids(700, seed=12)
    assert fleet.pd(fleet.prefill, fleet.decode_fail, prompt).token_ids == fleet.expected(prompt)


def test_prefill_killed_mid_transfer_decode_fails_or_recomputes_per_policy(
        fleet: Fleet) -> None:
    prompt = prompt_ids(LONG, seed=21)
    expected = fleet.expected(prompt)
    failing, recomputing = "fail-" + uuid.uuid4().hex, "recompute-" + uuid.uuid4().hex
    victim = fleet.prefill_victim
    errors_before = {d.name: request_errors(d) for d in (fleet.decode_fail,
                                                         fleet.decode_recompute)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        # Mid-transfer: prefill has posted the first of the prompt's 6 chunks. This model's
        # chunks take milliseconds (and prefill's token budget runs one prompt at a time),
        # so prefill is frozen at once (SIGSTOP: it holds its connections and answers
        # nothing) and killed once the recompute decode has asked it for its KV too.
        to_fail = pool.submit(fleet.pd, victim, fleet.decode_fail, prompt, failing,
                              prefill_must_answer=False)
        wait_for("prefill posted the failing room's first chunk",
                 lambda: events(victim, failing, "post"), timeout_s=60, interval_s=0.002)
        victim.server.freeze()
        assert not events(victim, failing, "end"), "the transfer ended before prefill froze"
        to_recompute = pool.submit(fleet.pd, victim, fleet.decode_recompute, prompt,
                                   recomputing, prefill_must_answer=False)
        wait_for("the recompute decode started its load",
                 lambda: events(fleet.decode_recompute, recomputing, "load_start"),
                 timeout_s=60, interval_s=0.01)
        victim.server.kill()
        failed = _exception(to_fail)
        recomputed = _exception(to_recompute)
    # fail: vLLM ends the request with an error (HTTP 500) and decode's log says why.
    assert failed is not None and "answered 500" in str(failed), failed
    (end,) = events(fleet.decode_fail, failing, "end")
    assert end["state"] == "Failed"
    assert f"room {failing}: KV load failed: " in fleet.decode_fail.server.log_text()
    # recompute: the same request completes from decode's own forward, token-identical.
    assert recomputed is None, recomputed
    assert to_recompute.result().token_ids == expected
    (end,) = events(fleet.decode_recompute, recomputing, "end")
    assert end["state"] == "Failed"
    # The connector counts the request vLLM ended with an error (its pod's reports carry it
    # into the engine rollout's analysis), as vLLM's own counter does; a recomputed one is
    # no error.
    after = {d.name: request_errors(d) for d in (fleet.decode_fail, fleet.decode_recompute)}
    assert after == {fleet.decode_fail.name: tuple(
                         n + 1 for n in errors_before[fleet.decode_fail.name]),
                     fleet.decode_recompute.name: errors_before[fleet.decode_recompute.name]}
    for decode in (fleet.decode_fail, fleet.decode_recompute):
        assert_drains(decode, TRANSFER_S + 5)
        other = prompt_ids(300, seed=22)
        assert fleet.pd(fleet.prefill, decode, other).token_ids == fleet.expected(other)


def request_errors(server: PdTransferServer) -> tuple[float, float]:
    """The requests ``server``'s engine ended with an error: by the connector's count (its
    pod agent's metrics) and by vLLM's own (``finished_reason="error"``)."""
    counted = server.metric("pd_transfer_connector_request_errors_total")
    own = scrape(f"{server.server.host}:{server.server.port}", "vllm:request_success_total",
                 engine="0", model_name=SERVED_MODEL_NAME, finished_reason="error")
    assert counted is not None and own is not None, (server.name, counted, own)
    return counted, own


def _exception(future: Future[CompletionResult]) -> BaseException | None:
    try:
        future.result(timeout=120)
    except Exception as exc:
        return exc
    return None


# Faults for the 200-request run: each is a real condition, not a hook in the connector.
FAULTS = (
    "ok",                   # P and D, both halves: must be token-identical
    "prefill_unreachable",  # decode names a port where no pod listens
    "decode_unreachable",   # prefill names a port where no pod listens
    "prefill_never_asked",  # decode's half only: prefill refuses the unknown room
    "decode_never_asks",    # prefill's half only: prefill's KV lease runs out
    "rooms_differ",         # both halves under different rooms: prefill's lease runs out,
    #                         decode (recompute policy) is refused and computes the prompt
    "client_leaves",        # both halves; decode's client disconnects mid-transfer
    "bad_params",           # decode's params are malformed: served without a transfer
)


def test_200_requests_with_faults_all_end_and_leave_nothing_held(fleet: Fleet) -> None:
    rng = random.Random(2026)
    dead = f"127.0.0.1:{free_ports(1)[0]}"
    prompts = {n: prompt_ids(n, seed=300 + n) for n in (1, 40, 257, 700)}
    # Several requests share each batch here: a tie in greedy's choice may go either way
    # (`greedy_disagreement`), so the references carry their top two tokens' logprobs.
    expected = {n: fleet.reference(p) for n, p in prompts.items()}

    def agrees(length: int, got: list[int]) -> str:
        return "identical" if greedy_disagreement(expected[length], got) is None else "DIFFERENT"
    prefill, decode, recompute = fleet.prefill, fleet.decode_fail, fleet.decode_recompute

    plan = [(FAULTS[i] if i < len(FAULTS) else rng.choice(FAULTS), rng.choice(list(prompts)))
            for i in range(200)]
    failures: list[str] = []  # the errors of requests that should have been answered

    def run(index: int) -> tuple[str, str]:
        fault, length = plan[index]
        prompt, room = prompts[length], f"fault-{index}-{uuid.uuid4().hex[:8]}"
        load = {"pd_transfer": {"room": room, "prefill": prefill.bootstrap}}
        send = {"pd_transfer": {"room": room, "decode": decode.bootstrap}}
        try:
            if fault == "ok":
                got = fleet.pd(prefill, decode, prompt, room).token_ids
                return fault, agrees(length, got)
            if fault == "prefill_unreachable":
                complete(decode.server, prompt, MAX_TOKENS,
                         {"pd_transfer": {"room": room, "prefill": dead}})
            elif fault == "decode_unreachable":
                complete(prefill.server, prompt, 1,
                         {"pd_transfer": {"room": room, "decode": dead}})
                return fault, "prefill answered"
            elif fault == "prefill_never_asked":
                got = complete(recompute.server, prompt, MAX_TOKENS, load).token_ids
                return fault, agrees(length, got)
            elif fault == "decode_never_asks":
                complete(prefill.server, prompt, 1, send)
                return fault, "prefill answered"
            elif fault == "rooms_differ":
                with ThreadPoolExecutor(max_workers=1) as one:
                    first = one.submit(complete, prefill.server, prompt, 1, {"pd_transfer": {
                        "room": room + "-p", "decode": recompute.bootstrap}})
                    got = complete(recompute.server, prompt, MAX_TOKENS, {"pd_transfer": {
                        "room": room + "-d", "prefill": prefill.bootstrap}}).token_ids
                    first.result()
                return fault, agrees(length, got)
            elif fault == "client_leaves":
                fleet.pd(prefill, decode, prompt, room, timeout_s=0.05)
                return fault, "finished before leaving"
            else:
                got = complete(decode.server, prompt, MAX_TOKENS,
                               {"pd_transfer": {"room": "../" + room, "prefill": 7}}).token_ids
                return fault, agrees(length, got)
            return fault, "UNEXPECTED success"
        except TimeoutError:
            return fault, "client left"
        except RuntimeError as exc:
            if fault in ("ok", "prefill_never_asked", "rooms_differ", "bad_params"):
                failures.append(f"{fault} {room}: {exc}"[:1500])  # why one failed
            return fault, "500" if "answered 500" in str(exc) else f"ERROR {exc}"

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = Counter(pool.map(run, range(200)))
    elapsed = time.monotonic() - started
    print(f"200 requests with faults in {elapsed:.1f} s: {dict(outcomes)}")
    allowed = {
        "ok": {"identical"},
        "prefill_unreachable": {"500"},
        "decode_unreachable": {"prefill answered"},
        "prefill_never_asked": {"identical"},
        "decode_never_asks": {"prefill answered"},
        "rooms_differ": {"identical"},
        # Both halves share the 50 ms timeout and the prefill half is sent first: its
        # client can leave first, prefill then aborts the transfer, and decode (policy
        # fail) answers 500 before its own client leaves. Each way the request ends.
        "client_leaves": {"client left", "finished before leaving", "500"},
        "bad_params": {"identical"},
    }
    wrong = {key: n for key, n in outcomes.items() if key[1] not in allowed[key[0]]}
    assert wrong == {}, (f"unexpected outcomes: {wrong} (all: {dict(outcomes)}); the first "
                         f"errors: {failures[:2]}")
    assert {fault for fault, _ in outcomes} == set(FAULTS)
    for server in (prefill, decode, recompute):
        assert_drains(server, TRANSFER_S + LEASE_S + 5)
