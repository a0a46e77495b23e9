"""Fixtures the end-to-end modules share, so a session starts each vLLM engine it needs once.

- `tiny_llama` (session): the PDTransferConnector tests' model (`TINY_LLAMA`, seeded weights)
  written once, and one plain vLLM serving it with the same chunked-prefill budget: the
  reference every P/D completion of that model must equal token for token. Started on first
  use (a vLLM start costs half a minute to several minutes on 2 loaded cores); stopped at
  the session's end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pd_testbed.vllm import (
    CHUNK_TOKENS,
    TINY_LLAMA,
    ServedModel,
    VllmServer,
    free_ports,
    running,
    vllm_env_or_skip,
)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    vllm = vllm_env_or_skip()
    root = tmp_path_factory.mktemp("tiny-llama")
    model_dir = TINY_LLAMA.write(root / "model", vllm)
    (port,) = free_ports(1)
    single = VllmServer(role="single", port=port, vllm=vllm, model_dir=model_dir, log_dir=root,
                        max_num_batched_tokens=CHUNK_TOKENS)
    with running([single]):
        yield ServedModel(vllm, model_dir, single)
