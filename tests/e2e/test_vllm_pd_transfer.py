"""Real vLLM (CPU backend) moves its KV cache with PDTransferConnector.

Three vLLM servers as real processes: a single instance (the reference, the session's
`tiny_llama`: tests/e2e/conftest.py), a prefill
(``kv_producer``) and a decode (``kv_consumer``), our connector loaded through vLLM's
``kv_connector_module_path``, real NIXL (UCX) between the two. Greedy completions through
P then D must be token-identical to the single instance's.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from pd_testbed.vllm import (
    CHUNK_TOKENS,
    TINY_LLAMA,
    CompletionResult,
    HttpTarget,
    PdTransferPair,
    ServedModel,
    VllmServer,
    complete,
    greedy_disagreement,
    pd_transfer_complete,
    pd_transfer_pair,
    prompt_ids,
    running,
)
from pd_transfer.router import PolicyName, Router, RouterSettings

# The first test's setup starts several vLLM engines (and, first in a session, the shared
# reference engine: tests/e2e/conftest.py), half a minute to several minutes each on 2 loaded cores.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = TINY_LLAMA
BATCH_TOKENS = CHUNK_TOKENS  # the chunked-prefill budget: longer prompts are prefilled in chunks
MAX_TOKENS = 8


@dataclass
class Deployment:
    single: VllmServer
    pair: PdTransferPair
    router: Router

    def pd(self, prompt: list[int], max_tokens: int = MAX_TOKENS,
           room: str | None = None) -> CompletionResult:
        return pd_transfer_complete(self.pair, prompt, max_tokens,
                                    room=room or uuid.uuid4().hex)

    def timeline(self, role: str) -> list[dict[str, Any]]:
        return self.pair.timeline(role)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory,
               tiny_llama: ServedModel) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("vllm-pd-transfer")
    pair = pd_transfer_pair(tiny_llama.vllm, MODEL, tiny_llama.model_dir, root,
                            max_num_batched_tokens=BATCH_TOKENS)
    single = tiny_llama.single
    with running([pair.prefill, pair.decode]):
        router = Router(RouterSettings(
            host="127.0.0.1", port=0, policy=PolicyName.ROUND_ROBIN,
            prefill=(f"http://127.0.0.1:{pair.prefill.port}@{pair.prefill_bootstrap}",),
            decode=(f"http://127.0.0.1:{pair.decode.port}@{pair.decode_bootstrap}",)))
        try:
            yield Deployment(single, pair, router)
        finally:
            router.close()


# 22 prompts: 1 to 1500 tokens, page boundaries, several longer than the chunked-prefill
# budget, and four that share a 600-token prefix.
LENGTHS = [1, 2, 31, 32, 33, 64, 100, 255, 256, 257, 300, 511, 512, 700, 1000, 1021, 1200, 1500]
SHARED = prompt_ids(600, seed=99)
PROMPTS = [prompt_ids(n, seed=n) for n in LENGTHS] + [
    SHARED + prompt_ids(n, seed=1000 + n) for n in (1, 40, 200, 500)]


def test_pd_completions_are_token_identical_to_one_vllm(deployment: Deployment) -> None:
    """Several requests in flight through P/D give the single instance's greedy tokens, one
    request at a time. Where the reference's top two tokens are tied (`TIE_LOGPROB_GAP`),
    the batch decides which one greedy takes, in one server as in two; a P/D completion that
    took the other one agrees up to there (`greedy_disagreement`), and nothing else is
    excused."""
    expected = [complete(deployment.single, p, MAX_TOKENS, top_logprobs=2) for p in PROMPTS]
    assert all(len(e.token_ids) == MAX_TOKENS for e in expected)
    with ThreadPoolExecutor(max_workers=4) as pool:  # several requests in flight
        got = list(pool.map(lambda p: deployment.pd(p).token_ids, PROMPTS))
    identical = sum(e.token_ids == g for e, g in zip(expected, got, strict=True))
    disagreeing = {len(p): why for p, e, g in zip(PROMPTS, expected, got, strict=True)
                   if (why := greedy_disagreement(e, g)) is not None}
    assert disagreeing == {}, f"prompt lengths whose P/D tokens differ: {disagreeing}"
    # Ties are rare: most completions must match token for token.
    assert identical >= len(PROMPTS) - 2, f"only {identical} of {len(PROMPTS)} identical"


def test_the_router_serves_token_identical_completions(deployment: Deployment) -> None:
    host, port = deployment.router.url.removeprefix("http://").split(":")
    router = HttpTarget("router", host, int(port))
    for prompt in (PROMPTS[3], PROMPTS[-1]):
        expected = complete(deployment.single, prompt, MAX_TOKENS).token_ids
        assert complete(router, prompt, MAX_TOKENS).token_ids == expected
        assert complete(router, prompt, MAX_TOKENS, stream=True).token_ids == expected


def test_layer_pipeline_posts_the_first_group_before_the_forward_ends(
        deployment: Deployment) -> None:
    room = "pipeline-" + uuid.uuid4().hex
    prompt = prompt_ids(1500, seed=7)
    expected = complete(deployment.single, prompt, MAX_TOKENS).token_ids
    assert deployment.pd(prompt, room=room).token_ids == expected
    events = [e for e in deployment.timeline("prefill") if room in e["rooms"]]
    posts = [e for e in events if e["event"] == "post"]
    ends = [e["t"] for e in events if e["event"] == "forward_end"]
    # 1500 tokens in chunks of 256: 6 chunks, each >= min_tokens, so each is split into
    # groups; the first group covers layers [0, k) with k < 4 and is posted mid-forward.
    first = posts[0]
    assert first["layers"] is not None and first["layers"][0] == 0
    assert first["layers"][1] < MODEL.layers
    assert first["t"] < min(t for t in ends if t >= first["t"])
    assert len(ends) == 6
    assert sum(1 for e in posts if e["last"]) == 1
    # A short prompt takes the plain path: one part, every layer.
    short_room = "plain-" + uuid.uuid4().hex
    deployment.pd(prompt_ids(40, seed=8), room=short_room)
    short = [e for e in deployment.timeline("prefill")
             if short_room in e["rooms"] and e["event"] == "post"]
    assert [(e["layers"], e["last"]) for e in short] == [(None, True)]


def _drain(role: str, engine: VllmServer, connector: str) -> subprocess.Popen[str]:
    """`pd-transfer drain` as the pod's preStop hook runs it, against one engine."""
    return subprocess.Popen(
        [sys.executable, "-m", "pd_transfer.cli", "drain", "--role", role, "--engine", "vllm",
         "--engine-metrics-url", f"http://127.0.0.1:{engine.port}/metrics",
         "--connector-metrics-url", f"http://{connector}/metrics",
         "--timeout-seconds", "60", "--interval-seconds", "0.2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_a_leaving_prefill_drains_only_once_decode_pulled_the_kv_it_holds(
        deployment: Deployment) -> None:
    """Guards against a scaled-down prefill stopped while a decode has yet to pull its KV
    (docs/failure-modes.md #39): its preStop hook waits for the pull, then for nothing."""
    pair, room = deployment.pair, "drain-" + uuid.uuid4().hex
    prompt = prompt_ids(300, seed=11)
    expected = complete(deployment.single, prompt, MAX_TOKENS).token_ids
    # Prefill computes the prompt and holds its KV for a decode that has not asked yet.
    complete(pair.prefill, prompt, 1, {"pd_transfer": {"room": room,
                                                       "decode": pair.decode_bootstrap}})
    with _drain("prefill", pair.prefill, pair.prefill_side.metrics) as drain:
        time.sleep(3.0)
        assert drain.poll() is None, "drained while the KV was still held"
        got = complete(pair.decode, prompt, MAX_TOKENS,
                       {"pd_transfer": {"room": room, "prefill": pair.prefill_bootstrap}})
        said = drain.communicate(timeout=30)[1].splitlines()
        code = drain.returncode
    assert got.token_ids == expected
    assert code == 0, said
    assert said[0].startswith("draining prefill: 0 running, 0 waiting, 1 KV transfers not "
                              "yet pulled ("), said
    assert said[-2].startswith("draining prefill: 0 running, 0 waiting, 0 KV transfers not "
                               "yet pulled ("), said
    assert said[-1].startswith("drained prefill after "), said
    # The pull ended before the hook did: decode's load of the room is in its timeline.
    assert [e for e in deployment.timeline("decode") if room in e["rooms"]
            and e["event"] == "end"], "no end of the room's load in decode's timeline"


def test_a_leaving_decode_drains_once_its_generation_ended(deployment: Deployment) -> None:
    pair = deployment.pair
    prompt = prompt_ids(200, seed=12)
    with ThreadPoolExecutor(max_workers=1) as pool:
        generating = pool.submit(deployment.pd, prompt, 96)
        time.sleep(0.5)
        with _drain("decode", pair.decode, pair.decode_side.metrics) as drain:
            said = drain.communicate(timeout=60)[1].splitlines()
        assert generating.done(), "the hook returned while the generation ran"
        assert len(generating.result().token_ids) == 96
    assert drain.returncode == 0, said
    assert said[-1].startswith("drained decode after "), said
