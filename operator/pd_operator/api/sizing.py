"""Staging sizes from the KV geometry and the parallelism of both roles.

The decode ring of one rank must hold one prefill chunk for every layer it serves: its writers
together send it exactly its local KV heads (each head once), for the layers of its pipeline
stage, for K and V. The prefill buffer of one rank holds the head slices it gathers for every
decode rank it sends to: its own heads, or, when decode ranks replicate heads (decode TP above
the KV head count), one head per decode rank it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_contract.transferagent import BYTES_PER_MIB
from pd_operator.api.spec import PDDeploymentSpec
from pd_operator.api.types import KV_DTYPE_BYTES, Attention, StagingMode, TransferBackend


def local_kv_heads(num_kv_heads: int, attention_tp: int) -> int:
    """KV heads held by one rank; heads are replicated when there are more ranks than heads."""
    return max(1, num_kv_heads // attention_tp)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StagingFootprint:
    """Bytes one prefill chunk occupies in the staging buffers, with the factors named."""

    chunk_tokens: int
    decode_heads: int
    prefill_heads_sent: int
    head_dim: int
    dtype_bytes: int
    decode_layers: int
    prefill_layers: int

    @property
    def decode_chunk_bytes(self) -> int:
        return (
            self.chunk_tokens
            * self.decode_heads
            * self.head_dim
            * self.dtype_bytes
            * 2
            * self.decode_layers
        )

    @property
    def prefill_chunk_bytes(self) -> int:
        return (
            self.chunk_tokens
            * self.prefill_heads_sent
            * self.head_dim
            * self.dtype_bytes
            * 2
            * self.prefill_layers
        )

    @property
    def min_decode_pool_mib(self) -> int:
        return ceil_div(self.decode_chunk_bytes, BYTES_PER_MIB)

    @property
    def min_prefill_buffer_mib(self) -> int:
        return ceil_div(self.prefill_chunk_bytes, BYTES_PER_MIB)


def compute_staging_footprint(spec: PDDeploymentSpec) -> StagingFootprint:
    heads = spec.model.num_kv_heads
    p_tp = spec.prefill.parallelism.attention_tp
    d_tp = spec.decode.parallelism.attention_tp
    page = spec.prefill.page_size
    # The transfer moves whole pages: a chunk occupies its tokens rounded up to pages.
    chunk_tokens = ceil_div(spec.prefill.chunked_prefill_tokens, page) * page
    return StagingFootprint(
        chunk_tokens=chunk_tokens,
        decode_heads=local_kv_heads(heads, d_tp),
        prefill_heads_sent=max(local_kv_heads(heads, p_tp), ceil_div(d_tp, p_tp)),
        head_dim=spec.model.head_dim,
        dtype_bytes=KV_DTYPE_BYTES[spec.model.kv_dtype.value],
        decode_layers=spec.model.num_layers // spec.decode.parallelism.pipeline,
        prefill_layers=spec.model.num_layers // spec.prefill.parallelism.pipeline,
    )


def staging_in_use(spec: PDDeploymentSpec) -> bool:
    """Whether transfers of this deployment go through the staging buffers."""
    if spec.transfer_backend is not TransferBackend.PD_TRANSFER:
        return False  # the engine's own connector: no staging buffers of ours
    if spec.model.attention is Attention.MLA:
        return False
    mode = spec.transfer.staging.mode
    if mode is StagingMode.ALWAYS:
        return True
    if mode is StagingMode.NEVER:
        return False
    return spec.prefill.parallelism.attention_tp != spec.decode.parallelism.attention_tp
