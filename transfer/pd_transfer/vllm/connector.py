"""``PDTransferConnector``: vLLM's KV connector API (``KVConnectorBase_V1``) over pd_transfer.

The only module that imports vLLM. Each hook converts vLLM's objects into plain ids and
counts and hands them to ``scheduler.SchedulerSide`` (scheduler process) or a
``rank.RankSide`` (each TP worker process: ``prefill_rank.PrefillRankSide`` or
``decode_rank.DecodeRankSide``, opened for the engine's role, then called alike); see those
modules for the request flow.

Per worker process (one per TP rank): the rank's KV caches wrapped in place
(``cache.map_kv_caches``), a NIXL agent, a ``PrefillSender`` (``kv_producer``) or
``DecodeReceiver`` (``kv_consumer``) stepped by its own thread, and a bootstrap server on
``bootstrap_port + tp_rank``, so a peer that knows rank 0's address finds every rank. That
server also carries the rank's control routes (``rank_control``), through which the pod's
one agent (``pod_agent.PodAgent``, started by the scheduler side) reads and resizes it.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from pd_contract.names import ENV_POD_IP, ENV_POD_NAME
from pd_contract.transferagent import Role
from pd_transfer.agent.transport_probe import UcxLogTail
from pd_transfer.endpoint import Endpoint, RankIdentity, Timeouts
from pd_transfer.kv.plan import Parallelism, RankCoord
from pd_transfer.protocol.handoff import ParamsError
from pd_transfer.rank.config_file import load_transfer_config
from pd_transfer.rank.opening import (
    OpenRank,
    RankOptions,
    open_decode_rank,
    open_prefill_rank,
)
from pd_transfer.rank.pod_peers import PodConnections
from pd_transfer.trust.auth import PeerAuth
from pd_transfer.trust.bootstrap import bound_agent_name
from pd_transfer.vllm.cache import map_kv_caches
from pd_transfer.vllm.decode_rank import DecodeRankSide
from pd_transfer.vllm.params import ConnectorSettings
from pd_transfer.vllm.pod_agent import PodAgent, rank_host, start_pod_agent
from pd_transfer.vllm.prefill_rank import PrefillRankSide
from pd_transfer.vllm.rank import RankSide
from pd_transfer.vllm.rank_control import RankControl, start_transport_probe
from pd_transfer.vllm.scheduler import ScheduledPrompt, SchedulerSide
from pd_transfer.vllm.steps import StepPlan
from pd_transfer.vllm.timeline import Timeline
from pd_transfer.vllm.versions import check_vllm_version

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PDTransferConnector", "PDTransferMetadata"]

log = logging.getLogger(__name__)

_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}


class PDTransferMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """The step plan vLLM ships from the scheduler to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class PDTransferConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Prefill (``kv_producer``) writes each prompt's KV into decode (``kv_consumer``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        kv_role = transfer_config.kv_role
        if kv_role not in _ROLES:
            raise ParamsError(
                f"PDTransferConnector needs kv_role kv_producer (prefill) or kv_consumer "
                f"(decode), got {kv_role!r}")
        self._engine_role: str = _ROLES[kv_role]
        self._settings = ConnectorSettings.from_extra_config(
            transfer_config.kv_connector_extra_config)
        # One name for every TP worker of this engine: peers check a pod's ranks agree.
        self._instance: str = (self._settings.instance or os.environ.get(ENV_POD_NAME)
                               or transfer_config.engine_id)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ParamsError(
                f"PDTransferConnector supports pipeline_parallel_size 1 with vLLM, got "
                f"{parallel.pipeline_parallel_size}")
        self._tp_size: int = parallel.tensor_parallel_size
        self._block_size: int = vllm_config.cache_config.block_size
        self._scheduler = (SchedulerSide(self._engine_role, self._block_size)  # type: ignore[arg-type]
                           if role == KVConnectorRole.SCHEDULER else None)
        self._rank: RankSide[Any] | None = None
        self._opened: OpenRank[Endpoint[Any]] | None = None
        self._timeline: Timeline | None = None
        self._ucx_tail: UcxLogTail | None = None
        self._agent: PodAgent | None = None
        if self._scheduler is not None:
            self._agent = start_pod_agent(self._settings, self._engine_role,  # type: ignore[arg-type]
                                          self._tp_size, self._scheduler.live_requests,
                                          self._scheduler.request_counts)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer posts layer groups between graph pieces

    # Scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        scheduler = self._scheduler
        assert scheduler is not None
        try:
            scheduler.track(request.request_id, request.kv_transfer_params,
                            len(request.prompt_token_ids or ()))
        except ParamsError as exc:
            log.error("request %s is served without a KV transfer: %s", request.request_id, exc)
            return 0, False
        return scheduler.matched_tokens(request.request_id, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request.request_id, blocks.get_block_ids()[0],
                                    num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDTransferMetadata:
        assert self._scheduler is not None
        return PDTransferMetadata(self._scheduler.build(_scheduled(scheduler_output)))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        completed = request.num_computed_tokens >= request.num_prompt_tokens
        errored = request.status == RequestStatus.FINISHED_ERROR
        return self._scheduler.finished(request.request_id, completed_prompt=completed,
                                        errored=errored), None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.transfers_done(connector_output.finished_sending or (),
                                       connector_output.finished_recving or ())

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_sends()

    # Worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Imported here: NIXL loads only in worker processes, after vLLM set the device up.
        from vllm.distributed.parallel_state import (  # noqa: PLC0415
            get_tensor_model_parallel_rank,
        )

        from pd_transfer.transport.nixl import NixlTransport  # noqa: PLC0415

        settings = self._settings
        config = load_transfer_config(settings.config_file)
        tp_rank = get_tensor_model_parallel_rank() if self._tp_size > 1 else 0
        cache = map_kv_caches(kv_caches, config.model, tp_size=self._tp_size, tp_rank=tp_rank)
        auth = PeerAuth.from_file(settings.key_file, settings.identity_file)
        timeouts = Timeouts.from_config(config.timeouts)
        # Bound to the pod IP the router hands out as this pod's bootstrap address (a peer
        # refuses a document whose agent is bound to another host: docs/failure-modes.md #48).
        agent = bound_agent_name(
            f"vllm-{self._engine_role}-r{tp_rank}-{self._instance}-{uuid.uuid4().hex[:8]}",
            os.environ.get(ENV_POD_IP) or rank_host(settings.bind_host))
        probe, self._ucx_tail = start_transport_probe()  # before the first NIXL agent
        transport = NixlTransport(agent)
        identity = RankIdentity(self._instance, RankCoord(0, tp_rank),
                                Parallelism(self._tp_size), cache.geometry)
        name, sizes = f"pd-transfer-{self._engine_role}-{tp_rank}", config.staging.sizes
        options = RankOptions(timeouts=timeouts, host=settings.bind_host,
                              port=(settings.bootstrap_port or config.network.bootstrap_port)
                              + tp_rank)
        if settings.timeline_file is not None:
            path = settings.timeline_file
            self._timeline = Timeline(path.with_name(f"{path.stem}-r{tp_rank}{path.suffix}"),
                                      tp_rank)

        def connections(endpoint: Endpoint[Any]) -> PodConnections:
            return PodConnections([endpoint], auth, cache.geometry, timeouts.bootstrap_s)

        # The half of this engine's role, over its typed endpoint; from here on both alike.
        rank: RankSide[Any]
        if self._engine_role == "prefill":
            prefill = open_prefill_rank(transport, cache.pool, identity, auth=auth,
                                        staging_bytes=sizes.bytes_for(Role.PREFILL), name=name,
                                        options=options)
            self._opened = prefill
            rank = PrefillRankSide(prefill.endpoint, connections(prefill.endpoint),
                                   cache.layer_names, config.layer_pipeline,
                                   device=cache.pool.device, timeline=self._timeline)
        else:
            decode = open_decode_rank(transport, cache.pool, identity, auth=auth,
                                      ring_bytes=sizes.bytes_for(Role.DECODE), name=name,
                                      options=options, mode=settings.path)
            self._opened = decode
            rank = DecodeRankSide(decode.endpoint, connections(decode.endpoint),
                                  timeline=self._timeline)
        self._rank, server = rank, self._opened.server
        RankControl(self._opened.endpoint, auth, live_requests=rank.live_requests, probe=probe,
                    transfer_timeout_s=timeouts.transfer_s).install(server)
        log.info("PDTransferConnector %s rank %d: %d layers, %s pages of %d tokens, bootstrap "
                 "on %s", self._engine_role, tp_rank, cache.layout.num_layers,
                 cache.layout.num_pages, cache.layout.page_size, server.address)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._rank is not None and isinstance(connector_metadata, PDTransferMetadata):
            self._rank.begin_step(connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._rank is not None:
            self._rank.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request is scheduled only after its KV landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._rank is not None:
            self._rank.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self._rank is not None:
            self._rank.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._rank is None:
            return KVConnectorTransferResults()
        results = self._rank.results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._rank.load_errors() if self._rank is not None else set()

    def shutdown(self) -> None:
        if self._agent is not None:
            self._agent.stop()
        if self._rank is not None:
            self._rank.close()
        if self._opened is not None:
            self._opened.close()
        if self._timeline is not None:
            self._timeline.close()
        if self._ucx_tail is not None:
            self._ucx_tail.stop()


def _scheduled(output: SchedulerOutput) -> list[ScheduledPrompt]:
    """This step's scheduled requests as ``ScheduledPrompt`` (group 0's blocks)."""
    tokens = output.num_scheduled_tokens
    prompts = [
        ScheduledPrompt(new.req_id, new.num_computed_tokens, tokens.get(new.req_id, 0),
                        tuple(new.block_ids[0]) if new.block_ids else ())
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    for index, req_id in enumerate(cached.req_ids):
        blocks = cached.new_block_ids[index]
        prompts.append(ScheduledPrompt(
            req_id, cached.num_computed_tokens[index], tokens.get(req_id, 0),
            tuple(blocks[0]) if blocks else (), req_id in cached.resumed_req_ids))
    return prompts
