"""vLLM's registered KV caches as a ``KVPool``, addressed in place, and their geometry.

vLLM 0.32 gives ``register_kv_caches`` one tensor per attention layer, logically
``[num_blocks, kv_heads, block_size, 2 * head_dim]``: the last dimension holds one
(token, head)'s K and V side by side, and every layer of a KV cache group is a slice of
one allocation at a fixed stride. The physical order inside a block is the backend's:

- ``[kv_heads, block_size, 2 * head_dim]`` (head-major; the CPU backend): ``HND``;
- ``[block_size, kv_heads, 2 * head_dim]`` (token-major): ``NHD``.

Either way a block of one layer is one contiguous run of bytes, which is all the
contiguous path needs, and a head slice of a block is a strided slice the staging path
gathers. K and V stay packed together (``KVPacking.PER_HEAD``): both sides of a pair
have the same packing, so the bytes move without being interpreted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pd_contract.config import ModelGeometry
from pd_transfer.kv.layout import KVLayout, KVPacking, PageFormat
from pd_transfer.kv.plan import compute_local_heads
from pd_transfer.kv.pool import KVPool
from pd_transfer.trust.bootstrap import DTYPES, GeometryDoc

__all__ = ["CacheGeometryError", "VllmCache", "map_kv_caches"]

_LAYER_NUMBER = re.compile(r"\d+")


class CacheGeometryError(ValueError):
    """vLLM's KV caches do not match the transfer config, or have a layout we cannot move."""


@dataclass(frozen=True)
class VllmCache:
    """The rank's KV caches: layer names in model order, their layout, the pool over them."""

    layer_names: tuple[str, ...]
    layout: KVLayout
    pool: KVPool
    geometry: GeometryDoc


def _layer_order(names: list[str]) -> list[str]:
    """Layer names sorted by the layer number each carries (``model.layers.7.self_attn``)."""
    numbered: list[tuple[int, str]] = []
    for name in names:
        numbers = _LAYER_NUMBER.findall(name)
        if len(numbers) != 1:
            raise CacheGeometryError(
                f"KV cache layer name {name!r} must carry exactly one layer number")
        numbered.append((int(numbers[0]), name))
    numbered.sort()
    return [name for _, name in numbered]


def _page_format(tensor: torch.Tensor, name: str) -> PageFormat:
    _, heads, size, content = tensor.shape
    s_block, s_head, s_token, s_content = tensor.stride()
    if s_content != 1 or s_block != heads * size * content:
        raise CacheGeometryError(
            f"layer {name}: strides {tensor.stride()} of shape {tuple(tensor.shape)} are not "
            f"whole contiguous blocks; this vLLM KV cache layout is not supported")
    if s_head == size * content and s_token == content:
        return PageFormat.HND
    if s_token == heads * content and s_head == content:
        return PageFormat.NHD
    raise CacheGeometryError(
        f"layer {name}: strides {tensor.stride()} order heads and tokens in neither head-major "
        f"nor token-major blocks")


def map_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    model: ModelGeometry,
    *,
    tp_size: int,
    tp_rank: int,
) -> VllmCache:
    """Check vLLM's caches against the deployment's model geometry and wrap them.

    Raises CacheGeometryError naming the field and both values when vLLM's model and the
    transfer config disagree (the config is what the peer pods are checked against)."""
    if not kv_caches:
        raise CacheGeometryError("vLLM registered no KV cache tensors")
    if model.attention != "MHA":
        raise CacheGeometryError(
            f"the transfer config says attention {model.attention}; the vLLM connector moves "
            f"MHA/GQA caches only")
    names = _layer_order(list(kv_caches))
    first = kv_caches[names[0]]
    if first.dim() != 4:
        raise CacheGeometryError(
            f"layer {names[0]}: KV cache of shape {tuple(first.shape)}; expected "
            f"[num_blocks, kv_heads, block_size, 2 * head_dim]")
    blocks, heads, block_size, content = first.shape
    local_heads = compute_local_heads(model.num_kv_heads, tp_size, tp_rank).count
    expected = {
        "num_layers": (len(names), model.num_layers),
        "kv_heads (this rank)": (heads, local_heads),
        "2 * head_dim": (content, 2 * model.head_dim),
        "dtype": (first.dtype, DTYPES[model.kv_dtype]),
    }
    for field, (vllm_value, config_value) in expected.items():
        if vllm_value != config_value:
            raise CacheGeometryError(
                f"vLLM's KV cache has {field}={vllm_value} but the transfer config's model "
                f"needs {field}={config_value}; serve the model the PDDeployment describes")
    page_format = _page_format(first, names[0])
    tensors: list[tuple[torch.Tensor]] = []
    for name in names:
        tensor = kv_caches[name]
        if tensor.shape != first.shape or tensor.stride() != first.stride() or (
                tensor.dtype != first.dtype or tensor.device != first.device):
            raise CacheGeometryError(
                f"layer {name}: KV cache {tuple(tensor.shape)} {tensor.dtype} on "
                f"{tensor.device} differs from layer {names[0]}'s; hybrid models are not "
                f"supported")
        physical = tensor if page_format is PageFormat.HND else tensor.transpose(1, 2)
        tensors.append((physical,))
    layout = KVLayout(len(names), blocks, block_size, heads, model.head_dim, first.dtype,
                      page_format=page_format, packing=KVPacking.PER_HEAD)
    geometry = GeometryDoc(
        num_layers=model.num_layers, total_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, dtype=model.kv_dtype, page_size=block_size,
        attention="MHA", page_format=page_format.value, packing=KVPacking.PER_HEAD.value)
    return VllmCache(tuple(names), layout, KVPool.from_layer_tensors(layout, tensors), geometry)
