"""Real vLLM servers (CPU backend) for end-to-end tests and benchmarks of KV connectors.

Reading order: `model` (the tiny Llama and its prompts) -> `environment` (ports, CPU
binding, `PYTHONPATH`, the vLLM env) -> `server` (one server process, several at once) ->
`completions` (requests and judging their tokens) -> `scrape` (Prometheus metrics) ->
`nixl_baseline` (vLLM's NixlConnector, the P/D baseline) -> `connector` (this project's
PDTransferConnector). Everything a test or benchmark uses is re-exported here.
"""

from pd_testbed.vllm.completions import (
    TIE_LOGPROB_GAP,
    CompletionResult,
    HttpTarget,
    Server,
    complete,
    greedy_disagreement,
)
from pd_testbed.vllm.connector import (
    PD_PIPELINE,
    TEST_TIMEOUTS,
    PdTransferPair,
    PdTransferServer,
    pd_transfer_args,
    pd_transfer_complete,
    pd_transfer_config,
    pd_transfer_key,
    pd_transfer_pair,
    pd_transfer_request,
    pd_transfer_server,
)
from pd_testbed.vllm.environment import (
    REQUIRE_VLLM_ENV,
    cpu_binding,
    free_ports,
    role_core,
    server_pythonpath,
    vllm_env_or_skip,
)
from pd_testbed.vllm.model import (
    CHUNK_TOKENS,
    SERVED_MODEL_NAME,
    TINY_LLAMA,
    ModelSpec,
    prompt_ids,
)
from pd_testbed.vllm.nixl_baseline import (
    NIXL_DECODE_TIMEOUT_S,
    NIXL_PREFILL_PARAMS,
    PdFailed,
    PdResult,
    nixl_kv_transfer_config,
    nixl_pd_complete,
    nixl_server_pair,
    warm_up_pd,
)
from pd_testbed.vllm.scrape import metrics_text, scrape, scrape_sum, vllm_metric
from pd_testbed.vllm.server import ServedModel, ServerDied, VllmServer, running, start_servers

__all__ = [
    "CHUNK_TOKENS",
    "NIXL_DECODE_TIMEOUT_S",
    "NIXL_PREFILL_PARAMS",
    "PD_PIPELINE",
    "REQUIRE_VLLM_ENV",
    "SERVED_MODEL_NAME",
    "TEST_TIMEOUTS",
    "TIE_LOGPROB_GAP",
    "TINY_LLAMA",
    "CompletionResult",
    "HttpTarget",
    "ModelSpec",
    "PdFailed",
    "PdResult",
    "PdTransferPair",
    "PdTransferServer",
    "ServedModel",
    "Server",
    "ServerDied",
    "VllmServer",
    "complete",
    "cpu_binding",
    "free_ports",
    "greedy_disagreement",
    "metrics_text",
    "nixl_kv_transfer_config",
    "nixl_pd_complete",
    "nixl_server_pair",
    "pd_transfer_args",
    "pd_transfer_complete",
    "pd_transfer_config",
    "pd_transfer_key",
    "pd_transfer_pair",
    "pd_transfer_request",
    "pd_transfer_server",
    "prompt_ids",
    "role_core",
    "running",
    "scrape",
    "scrape_sum",
    "server_pythonpath",
    "start_servers",
    "vllm_env_or_skip",
    "vllm_metric",
    "warm_up_pd",
]
