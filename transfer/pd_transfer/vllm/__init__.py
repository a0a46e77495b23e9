"""vLLM moves its KV cache with ``pd_transfer``: the ``PDTransferConnector`` KV connector.

vLLM loads it through its KV connector API (``KVConnectorBase_V1``)::

    --kv-transfer-config '{
        "kv_connector": "PDTransferConnector",
        "kv_connector_module_path": "pd_transfer.vllm.connector",
        "kv_role": "kv_producer" | "kv_consumer",
        "kv_connector_extra_config": {"config_file": "/etc/pd-transfer/config.json"}}'

| module | job |
|---|---|
| ``versions`` | the vLLM versions this connector is tested against; refuses others |
| ``params`` | the connector's settings (``kv_connector_extra_config``) |
| ``cache`` | vLLM's registered per-layer KV tensors as a ``KVPool`` (no copy), and its geometry |
| ``scheduler`` | the scheduler side: which requests load or send, the per-step metadata |
| ``rank`` | ``RankSide``, a TP rank's worker side both roles share: requests, peers, results |
| ``prefill_rank`` | its prefill half over a ``PrefillSender``: chunks, layer groups, posts |
| ``decode_rank`` | its decode half over a ``DecodeReceiver``: loads, load errors |
| ``rank_control`` | a rank's control routes (either role) on its bootstrap server: report, resize |
| ``pod_agent`` | the pod's one agent (scheduler process) over its ranks: reports, resizes |
| ``connector_metrics`` | the pod agent's own metrics: live requests, ranks read, request errors |
| ``connector`` | the ``KVConnectorBase_V1`` subclass vLLM loads (the only module importing vLLM) |
| ``steps``, ``timeline`` | the per-step plan sent to workers; an optional record of timestamps |

A request's ``kv_transfer_params`` (set by the router, read by ``scheduler``) are the
router↔engine contract ``pd_transfer.protocol.handoff``, which the router imports too.

Nothing here patches vLLM: every hook is a public connector method. The router that sends
each request to a prefill and a decode engine at once is ``pd_transfer.router``
(``pd-transfer router``).
"""
