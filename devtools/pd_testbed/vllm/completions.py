"""Completions from a vLLM server (or a router in front of several) and judging them.

`complete` sends token ids to `/v1/completions` and returns the generated token ids (vLLM's
`return_token_ids`; the servers run without a tokenizer), the response's
`kv_transfer_params`, and timings; with `stream=True` the TTFT is the time from sending the
request to the first streamed token. `greedy_disagreement` says whether tokens are what
greedy decoding gives, excusing only a tie in greedy's choice.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pd_testbed.vllm.model import SERVED_MODEL_NAME

__all__ = ["TIE_LOGPROB_GAP", "CompletionResult", "HttpTarget", "Server", "complete",
           "greedy_disagreement"]


@dataclass(frozen=True)
class CompletionResult:
    """One completion: generated token ids, the `kv_transfer_params` the server returned
    (non-streaming only), TTFT (streaming only: request sent -> first token received) and
    the whole request's latency."""

    token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    ttft_s: float | None
    latency_s: float
    finish_reason: str | None = None
    # Per generated token, its `top_logprobs` most likely tokens' logprobs (asked for only).
    top_logprobs: list[dict[int, float]] | None = None


# One bf16 step of the tiny models' logits (|logit| < 8 here): two tokens whose logprobs
# are this close are tied up to rounding, and which one greedy picks depends on the
# accumulation order of vLLM's CPU kernels, i.e. on which requests share the batch.
# Measured: a prompt whose reference had an exact tie at its 7th token got the runner-up
# from a single vLLM server with 3 other requests in flight.
TIE_LOGPROB_GAP = 1 / 64


def greedy_disagreement(reference: CompletionResult, got: Sequence[int]) -> str | None:
    """Why `got` is not what greedy decoding gives for `reference`'s prompt, or None.

    Identical tokens agree. So does a first difference where the reference's top two
    tokens are tied (within `TIE_LOGPROB_GAP`) and `got` took the other one: from there the
    two continuations are different prompts, so nothing after it is compared. Any other
    difference is a disagreement. `reference` must carry `top_logprobs` (>= 2)."""
    assert reference.top_logprobs is not None, "the reference needs top_logprobs"
    for step, (want, have) in enumerate(zip(reference.token_ids, got, strict=True)):
        if want == have:
            continue
        ranked = sorted(reference.top_logprobs[step].items(), key=lambda kv: -kv[1])
        tied = {token for token, logprob in ranked if ranked[0][1] - logprob <= TIE_LOGPROB_GAP}
        if have in tied:
            return None
        return (f"token {step}: {have} where greedy gives {want} (top logprobs "
                f"{dict(ranked)}; got {list(got)}, expected {reference.token_ids})")
    return None


def _request_body(prompt: Sequence[int], max_tokens: int, *, stream: bool,
                  kv_transfer_params: Mapping[str, Any] | None,
                  top_logprobs: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        # Exactly `max_tokens` tokens even if the dummy model emits EOS (id 2).
        "ignore_eos": True,
        # vLLM >= 0.10: `choices[i].token_ids` (the delta in streaming chunks). The servers
        # run with --skip-tokenizer-init, so `text` is "".
        "return_token_ids": True,
        "stream": stream,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    if top_logprobs:
        # Named "token_id:<id>": without a tokenizer vLLM cannot name them otherwise.
        body["logprobs"] = top_logprobs
        body["return_tokens_as_token_ids"] = True
    return body


def _top_logprobs(choice: Mapping[str, Any]) -> list[dict[int, float]] | None:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return None
    return [{int(name.removeprefix("token_id:")): float(value) for name, value in step.items()}
            for step in logprobs["top_logprobs"]]


class Server(Protocol):
    """What `complete` needs of a server: a vLLM server or a router in front of several."""

    @property
    def role(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


@dataclass(frozen=True)
class HttpTarget:
    """A server known only by its address (a router)."""

    role: str
    host: str
    port: int


def complete(server: Server, prompt: Sequence[int], max_tokens: int,
             kv_transfer_params: Mapping[str, Any] | None = None, *, stream: bool = False,
             timeout_s: float = 120.0, top_logprobs: int = 0) -> CompletionResult:
    """POST /v1/completions with token ids; greedy. See `CompletionResult`.
    `top_logprobs`: ask for that many most likely tokens per generated token."""
    body = json.dumps(_request_body(prompt, max_tokens, stream=stream,
                                    kv_transfer_params=kv_transfer_params,
                                    top_logprobs=top_logprobs)).encode()
    connection = http.client.HTTPConnection(server.host, server.port, timeout=timeout_s)
    try:
        connection.connect()
        started = time.perf_counter()
        connection.request("POST", "/v1/completions", body=body,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            detail = response.read().decode(errors="replace")
            raise RuntimeError(f"vLLM {server.role} answered {response.status}: {detail[:2000]}")
        if not stream:
            payload = json.loads(response.read())
            latency = time.perf_counter() - started
            choice = payload["choices"][0]
            return CompletionResult(token_ids=list(choice.get("token_ids") or []),
                                    kv_transfer_params=payload.get("kv_transfer_params"),
                                    ttft_s=None, latency_s=latency,
                                    finish_reason=choice.get("finish_reason"),
                                    top_logprobs=_top_logprobs(choice))
        return _read_stream(response, started)
    finally:
        connection.close()


def _read_stream(response: http.client.HTTPResponse, started: float) -> CompletionResult:
    token_ids: list[int] = []
    ttft: float | None = None
    finish_reason: str | None = None
    kv_params: dict[str, Any] | None = None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            raise RuntimeError(f"vLLM streamed an error: {chunk['error']}")
        if chunk.get("kv_transfer_params"):
            kv_params = chunk["kv_transfer_params"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("token_ids") or []
            if delta and ttft is None:
                ttft = time.perf_counter() - started
            token_ids.extend(delta)
            finish_reason = choice.get("finish_reason") or finish_reason
    latency = time.perf_counter() - started
    return CompletionResult(token_ids=token_ids, kv_transfer_params=kv_params, ttft_s=ttft,
                            latency_s=latency, finish_reason=finish_reason)
