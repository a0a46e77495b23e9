"""A small Llama-style transformer that writes and reads its KV through ``KVPool``s: the
stand-in engine for benchmarks and end-to-end tests, and a map of the integration points.

Random weights from a seed; RMSNorm, RoPE, grouped-query attention (``num_kv_heads`` may be
below ``num_heads``), SwiGLU MLP. Attention is ``torch.nn.functional.scaled_dot_product_
attention``: causal over a whole prompt, or with an explicit mask for a chunk that attends
to earlier chunks' KV.

Integration points an engine must offer the transfer module (see ``PIPELINE.md``):

1. Its KV cache as a ``KVPool``: per rank, K and V tensors ``[layers, pages * page_size,
   local_kv_heads, head_dim]``, token slot ``page_table[pos // page_size] * page_size +
   pos % page_size``. ``forward_layers`` writes exactly that layout.
2. A forward that runs a layer range (``forward_layers``, wrapped per chunk by
   ``ChunkForward``), so ``pipeline.LayerPipeline`` can post group ``g`` while ``g + 1``
   computes.
3. Chunked prefill reading earlier chunks' KV from the pool (``start_pos > 0``), so each
   chunk's pages can be sent as soon as that chunk is done.
4. Decode reading the transferred pool (``decode_step``): the same logits as prefill-side
   computation proves the transferred bytes are the ones attention needs.

The model computes in ``dtype`` and stores its KV in ``kv_dtype`` (default: ``dtype``), as
engines that keep an fp8 or bf16 cache under a wider compute do. Attention always reads K
and V at the pool's precision, fresh or from the pool, so a chunk computes the same whether
its context was computed here or arrived by transfer. A CPU without bf16 matrix units runs
bf16 matmuls on a slow path (``benchmarks/reference_compute_cpu.py``); the reference engine
therefore computes in float32 and keeps the KV at the deployment's ``kvDtype``.

Tensor parallelism is emulated in one process: with ``tp_size`` ranks, rank ``r`` owns
query heads ``[r * num_heads / tp, (r + 1) * num_heads / tp)`` and the KV heads
``plan.compute_local_heads`` gives it; it writes and reads only its own pool (``pools[r]``),
and the ranks' partial attention outputs are summed (the all-reduce of a real TP engine).
Each rank's pool therefore holds exactly what a real TP rank's would, which is what a
transfer test needs; this is not a fast TP implementation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.plan import HeadRange, compute_local_heads
from pd_transfer.kv.pool import KVPool

__all__ = ["ChunkForward", "GraphedChunkForward", "ModelConfig", "ReferenceModel"]


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of the reference model (Llama naming)."""

    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor  # [hidden, heads * head_dim]
    wk: torch.Tensor  # [hidden, kv_heads * head_dim]
    wv: torch.Tensor
    wo: torch.Tensor  # [heads * head_dim, hidden]
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor  # [hidden, intermediate]
    w_up: torch.Tensor
    w_down: torch.Tensor  # [intermediate, hidden]


class ReferenceModel:
    """The model's weights and its paged forward; see the module docstring."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        tp_size: int = 1,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        if tp_size <= 0 or config.num_heads % tp_size:
            raise ValueError(
                f"tp_size ({tp_size}) must divide num_heads ({config.num_heads}): each rank "
                f"owns a whole number of query heads"
            )
        for rank in range(tp_size):  # raises PlanError when TP and the KV heads do not fit
            compute_local_heads(config.num_kv_heads, tp_size, rank)
        self.config = config
        self.tp_size = tp_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, device=self.device, dtype=torch.float32)
            return (w / math.sqrt(rows)).to(dtype)

        def norm() -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(
                config.hidden_size, generator=gen, device=self.device, dtype=torch.float32
            )
            return w.to(dtype)

        c = config
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embedding = torch.randn(
            c.vocab_size, c.hidden_size, generator=gen, device=self.device, dtype=torch.float32
        ).to(dtype)
        self.layers = tuple(
            _Layer(
                attn_norm=norm(),
                wq=weight(c.hidden_size, q_width),
                wk=weight(c.hidden_size, kv_width),
                wv=weight(c.hidden_size, kv_width),
                wo=weight(q_width, c.hidden_size),
                mlp_norm=norm(),
                w_gate=weight(c.hidden_size, c.intermediate_size),
                w_up=weight(c.hidden_size, c.intermediate_size),
                w_down=weight(c.intermediate_size, c.hidden_size),
            )
            for _ in range(c.num_layers)
        )
        self.final_norm = norm()
        self.lm_head = weight(c.hidden_size, c.vocab_size)
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=self.device)
        self._inv_freq = 1.0 / (c.rope_theta ** (exponents / c.head_dim))

    # Geometry ---------------------------------------------------------------------------------

    def local_kv_heads(self, tp_rank: int) -> HeadRange:
        """The global KV heads TP rank ``tp_rank`` stores (``plan.compute_local_heads``)."""
        return compute_local_heads(self.config.num_kv_heads, self.tp_size, tp_rank)

    def local_q_heads(self, tp_rank: int) -> HeadRange:
        per_rank = self.config.num_heads // self.tp_size
        return HeadRange(tp_rank * per_rank, per_rank)

    def kv_layout(self, tp_rank: int, num_pages: int, page_size: int) -> KVLayout:
        """The ``KVLayout`` of rank ``tp_rank``'s pool."""
        return KVLayout(
            num_layers=self.config.num_layers,
            num_pages=num_pages,
            page_size=page_size,
            kv_heads=self.local_kv_heads(tp_rank).count,
            head_dim=self.config.head_dim,
            dtype=self.kv_dtype,
        )

    def allocate_pools(
        self, num_pages: int, page_size: int, device: torch.device | str | None = None
    ) -> tuple[KVPool, ...]:
        """One zeroed pool per TP rank, on ``device`` (default: the model's)."""
        return tuple(
            KVPool.allocate(self.kv_layout(rank, num_pages, page_size), device or self.device)
            for rank in range(self.tp_size)
        )

    # Forward ----------------------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids → ``[n, hidden]`` hidden states."""
        return self.embedding[token_ids.to(self.device)]

    def forward_layers(
        self,
        hidden: torch.Tensor,
        layers: range,
        *,
        pools: Sequence[KVPool],
        page_table: Sequence[int],
        start_pos: int,
    ) -> torch.Tensor:
        """Run ``layers`` over ``hidden`` (``[n, hidden]``, tokens ``[start_pos, start_pos +
        n)`` of one request) and return the new hidden states.

        Every layer writes the tokens' K and V (rank ``r``'s KV heads) into ``pools[r]`` at
        the slots ``page_table`` maps them to, and attends causally over the request's
        tokens ``[0, start_pos + n)``, reading ``[0, start_pos)`` from the pools: earlier
        chunks' KV, or KV that arrived by transfer. ``page_table`` lists the request's
        pages in token order and must cover ``start_pos + n`` tokens.
        """
        if len(pools) != self.tp_size:
            raise ValueError(f"forward_layers: {len(pools)} pools for tp_size {self.tp_size}")
        if layers.step != 1 or not 0 <= layers.start <= layers.stop <= self.config.num_layers:
            raise ValueError(f"forward_layers: {layers} is not a layer range of this model")
        n = hidden.shape[0]
        page_size = pools[0].layout.page_size
        if len(page_table) * page_size < start_pos + n:
            raise ValueError(
                f"forward_layers: page table of {len(page_table)} pages x {page_size} tokens "
                f"cannot hold tokens up to {start_pos + n}"
            )
        positions = torch.arange(start_pos, start_pos + n, device=self.device)
        slots = _token_slots(page_table, page_size, start_pos + n, self.device)
        cos, sin = self._rope(positions)
        for index in layers:
            hidden = self._layer(index, hidden, pools, slots, start_pos, cos, sin)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[n, hidden]`` → ``[n, vocab]`` (float32)."""
        return (_rms_norm(hidden, self.final_norm, self.config.rms_eps) @ self.lm_head).float()

    def prefill(
        self,
        token_ids: torch.Tensor,
        *,
        pools: Sequence[KVPool],
        page_table: Sequence[int],
        start_pos: int = 0,
    ) -> torch.Tensor:
        """All layers over ``token_ids`` (placed at ``start_pos``); the last token's logits."""
        hidden = self.forward_layers(
            self.embed(token_ids), range(self.config.num_layers),
            pools=pools, page_table=page_table, start_pos=start_pos,
        )
        return self.logits(hidden[-1:])[0]

    def decode_step(
        self, token_id: int, position: int, *, pools: Sequence[KVPool], page_table: Sequence[int]
    ) -> torch.Tensor:
        """One decode step: the token at ``position`` attends over ``[0, position]``, reading
        ``[0, position)`` from the pools (the transferred KV) and writing its own KV.
        Returns its ``[vocab]`` logits."""
        ids = torch.tensor([token_id], dtype=torch.int64, device=self.device)
        return self.prefill(ids, pools=pools, page_table=page_table, start_pos=position)

    def dense_forward(
        self, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Reference without any pool: a plain causal forward over dense per-layer K/V.

        Returns ``[n, vocab]`` logits and, per layer, K and V ``[n, num_kv_heads,
        head_dim]`` (every head, token order, ``kv_dtype``): what the paged paths must agree
        with.
        """
        cfg = self.config
        hidden = self.embed(token_ids)
        n = hidden.shape[0]
        cos, sin = self._rope(torch.arange(n, device=self.device))
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for layer in self.layers:
            x = _rms_norm(hidden, layer.attn_norm, cfg.rms_eps)
            q = _rope((x @ layer.wq).view(n, cfg.num_heads, cfg.head_dim), cos, sin)
            k = _rope((x @ layer.wk).view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = (x @ layer.wv).view(n, cfg.num_kv_heads, cfg.head_dim)
            k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)
            keys.append(k)
            values.append(v)
            out = _attention(q, k.to(self.dtype), v.to(self.dtype), start_pos=0)
            hidden = hidden + out.reshape(n, -1) @ layer.wo
            hidden = hidden + self._mlp(layer, hidden)
        return self.logits(hidden), tuple(keys), tuple(values)

    # Internals --------------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self._inv_freq[None, :]
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[:, None, :]
        sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[:, None, :]
        return cos.to(self.dtype), sin.to(self.dtype)

    def _mlp(self, layer: _Layer, hidden: torch.Tensor) -> torch.Tensor:
        x = _rms_norm(hidden, layer.mlp_norm, self.config.rms_eps)
        return (F.silu(x @ layer.w_gate) * (x @ layer.w_up)) @ layer.w_down

    def _layer(  # noqa: PLR0917 - private, one caller passing its loop state
        self,
        index: int,
        hidden: torch.Tensor,
        pools: Sequence[KVPool],
        slots: torch.Tensor,
        start_pos: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        cfg, layer = self.config, self.layers[index]
        n, d = hidden.shape[0], cfg.head_dim
        x = _rms_norm(hidden, layer.attn_norm, cfg.rms_eps)
        new_slots = slots[start_pos:]
        attn_out = torch.zeros_like(hidden)
        for rank, pool in enumerate(pools):
            qh, kvh = self.local_q_heads(rank), self.local_kv_heads(rank)
            q_cols = slice(qh.start * d, qh.stop * d)
            kv_cols = slice(kvh.start * d, kvh.stop * d)
            q = _rope((x @ layer.wq[:, q_cols]).view(n, qh.count, d), cos, sin)
            k = _rope((x @ layer.wk[:, kv_cols]).view(n, kvh.count, d), cos, sin)
            v = (x @ layer.wv[:, kv_cols]).view(n, kvh.count, d)
            k_stored, v_stored = k.to(self.kv_dtype), v.to(self.kv_dtype)
            pool.layer_k(index).index_copy_(0, new_slots, k_stored)
            pool.layer_v(index).index_copy_(0, new_slots, v_stored)
            if start_pos:
                # Earlier tokens come from the pool: earlier chunks, or transferred KV.
                old = slots[:start_pos]
                k_stored = torch.cat((pool.layer_k(index).index_select(0, old), k_stored))
                v_stored = torch.cat((pool.layer_v(index).index_select(0, old), v_stored))
            k, v = k_stored.to(self.dtype), v_stored.to(self.dtype)
            out = _attention(q, k, v, start_pos=start_pos)
            attn_out = attn_out + out.reshape(n, -1) @ layer.wo[q_cols, :]
        hidden = hidden + attn_out
        return hidden + self._mlp(layer, hidden)


class ChunkForward:
    """One prefill chunk bound to its inputs, callable per layer range: the ``GroupForward``
    that ``pipeline.LayerPipeline.run_chunk`` drives. Holds the hidden states between
    groups; ``logits()`` after the last group gives the chunk's last-token logits."""

    def __init__(
        self,
        model: ReferenceModel,
        token_ids: torch.Tensor,
        *,
        pools: Sequence[KVPool],
        page_table: Sequence[int],
        start_pos: int,
    ) -> None:
        self.model = model
        self.pools = tuple(pools)
        self.page_table = tuple(page_table)
        self.start_pos = start_pos
        self.hidden = model.embed(token_ids)
        self.layers_done = 0

    def __call__(self, layers: range) -> None:
        if layers.start != self.layers_done:
            raise ValueError(
                f"ChunkForward: layers must run in order; {self.layers_done} done, got {layers}"
            )
        self.hidden = self.model.forward_layers(
            self.hidden, layers, pools=self.pools, page_table=self.page_table,
            start_pos=self.start_pos,
        )
        self.layers_done = layers.stop

    def logits(self) -> torch.Tensor:
        """The chunk's last-token ``[vocab]`` logits; every layer must have run."""
        if self.layers_done != self.model.config.num_layers:
            raise ValueError(f"ChunkForward: only {self.layers_done} layers ran")
        return self.model.logits(self.hidden[-1:])[0]


class GraphedChunkForward:
    """``ChunkForward`` replayed from one CUDA graph per layer (GPU only).

    Same kernels, same results, same KV writes; what goes is the host's launch cost per
    kernel (about 45 per layer), which otherwise dominates a small model's forward: the
    host, not the GPU, would set the compute time a benchmark measures. Captured once for a
    chunk geometry (token count, pools, page table, start position); ``load(token_ids)``
    puts a chunk's tokens in, then it is called per layer range, in order, like
    ``ChunkForward``. Layer ``i``'s graph reads layer ``i - 1``'s output buffer, so any
    grouping of consecutive layers replays the same graphs. Captured in thread-local mode:
    other threads (the transfer worker) may use CUDA meanwhile.
    """

    def __init__(
        self,
        model: ReferenceModel,
        num_tokens: int,
        *,
        pools: Sequence[KVPool],
        page_table: Sequence[int],
        start_pos: int = 0,
    ) -> None:
        if model.device.type != "cuda":
            raise ValueError(f"GraphedChunkForward needs a CUDA model, not {model.device}")
        self.model = model
        self.num_tokens = num_tokens
        device = model.device
        self._input = torch.zeros(num_tokens, model.config.hidden_size, dtype=model.dtype,
                                  device=device)
        page_size = pools[0].layout.page_size
        # A graph holds raw addresses, not references: every tensor it reads must outlive
        # it, so the slots and rotary tables are attributes, not locals.
        self._slots = _token_slots(page_table, page_size, start_pos + num_tokens, device)
        self._rotary = model._rope(torch.arange(start_pos, start_pos + num_tokens,
                                                device=device))
        self._pools = tuple(pools)

        def run(index: int, hidden: torch.Tensor) -> torch.Tensor:
            return model._layer(index, hidden, self._pools, self._slots, start_pos,
                                *self._rotary)

        layers = range(model.config.num_layers)
        # Capture needs warmed-up libraries (cuBLAS handles, kernel selection): one eager
        # pass on a side stream first, as torch.cuda.graph's documentation prescribes.
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            hidden = self._input
            for index in layers:
                hidden = run(index, hidden)
        torch.cuda.current_stream(device).wait_stream(side)
        memory = torch.cuda.graph_pool_handle()
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._outputs: list[torch.Tensor] = []  # keeps each layer's output buffer alive
        hidden = self._input
        for index in layers:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory, capture_error_mode="thread_local"):
                hidden = run(index, hidden)
            self._graphs.append(graph)
            self._outputs.append(hidden)
        self.layers_done = 0

    def load(self, token_ids: torch.Tensor) -> GraphedChunkForward:
        """Put a chunk's tokens in (their count must be the captured one); returns self."""
        self._input.copy_(self.model.embed(token_ids))
        self.layers_done = 0
        return self

    def __call__(self, layers: range) -> None:
        if layers.start != self.layers_done:
            raise ValueError(f"GraphedChunkForward: layers must run in order; "
                             f"{self.layers_done} done, got {layers}")
        for index in layers:
            self._graphs[index].replay()
        self.layers_done = layers.stop

    def logits(self) -> torch.Tensor:
        """The chunk's last-token ``[vocab]`` logits; every layer must have run."""
        if self.layers_done != self.model.config.num_layers:
            raise ValueError(f"GraphedChunkForward: only {self.layers_done} layers ran")
        return self.model.logits(self._outputs[-1][-1:])[0]


def _token_slots(
    page_table: Sequence[int], page_size: int, num_tokens: int, device: torch.device
) -> torch.Tensor:
    """Pool slot of each token ``[0, num_tokens)`` of a request (int64)."""
    pos = torch.arange(num_tokens, device=device)
    pages = torch.as_tensor(list(page_table), dtype=torch.int64, device=device)
    return pages[pos // page_size] * page_size + pos % page_size


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``[n, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start_pos: int
) -> torch.Tensor:
    """Causal GQA attention of ``q`` ``[n, hq, d]`` (tokens ``[start_pos, start_pos + n)``)
    over ``k``/``v`` ``[start_pos + n, hkv, d]``; returns ``[n, hq, d]``."""
    n, hq, _ = q.shape
    ctx, hkv = k.shape[0], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if start_pos == 0:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        # SDPA's is_causal aligns the mask top-left; a chunk's queries sit at the end.
        q_pos = torch.arange(start_pos, start_pos + n, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.squeeze(0).transpose(0, 1)
