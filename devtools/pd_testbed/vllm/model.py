"""The tiny Llama every vLLM server of the test bed serves, and the prompts sent to it.

`ModelSpec` writes `config.json` and a seeded random checkpoint (`model.safetensors`), so
every server of one spec has the same weights whatever its tensor parallelism (vLLM's
`--load-format dummy` fills each TP shard from the same seed, which gives a TP-2 server other
weights than a TP-1 one), and greedy decoding is deterministic: two servers give the same
token ids for the same prompt.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_devcluster.vllm_env import VllmEnv

__all__ = ["CHUNK_TOKENS", "SERVED_MODEL_NAME", "TINY_LLAMA", "ModelSpec", "prompt_ids"]

SERVED_MODEL_NAME = "tiny-llama"
"""The name every server serves the model under (`--served-model-name`, requests' `model`)."""


@dataclass(frozen=True)
class ModelSpec:
    """A tiny Llama (`config.json` and seeded random weights, `write`)."""

    layers: int = 3
    kv_heads: int = 2
    hidden: int = 256
    heads: int = 4
    vocab: int = 1024
    intermediate: int = 512
    max_position: int = 4096
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, in `dtype` (2 bytes for bf16/fp16, 4 for fp32)."""
        itemsize = 4 if self.dtype in ("float32", "float") else 2
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize

    def config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "torch_dtype": self.dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        }

    def write(self, directory: Path, vllm: VllmEnv, *, seed: int = 0) -> Path:
        """Write `config.json` and `model.safetensors` (weights drawn from `seed`) into
        `directory` (created) and return it. The weights are written by the vLLM env's
        Python (torch and safetensors are there). Scales: embeddings N(0, 1), projections
        N(0, 1/fan_in), norms 1, so attention is far from uniform and a completion depends
        on the whole prompt's KV (a wrongly placed page changes the tokens)."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config(), indent=2) + "\n")
        shapes = self.weight_shapes()
        subprocess.run([str(vllm.python), "-c", _WRITE_WEIGHTS,
                        str(directory / "model.safetensors"), json.dumps(shapes), str(seed),
                        self.dtype], check=True, capture_output=True, timeout=300)
        return directory

    def weight_shapes(self) -> dict[str, list[int]]:
        """Hugging Face Llama parameter names and shapes."""
        hidden, kv = self.hidden, self.kv_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": [self.vocab, hidden],
                  "model.norm.weight": [hidden], "lm_head.weight": [self.vocab, hidden]}
        for layer in range(self.layers):
            prefix = f"model.layers.{layer}."
            shapes |= {
                prefix + "self_attn.q_proj.weight": [hidden, hidden],
                prefix + "self_attn.k_proj.weight": [kv, hidden],
                prefix + "self_attn.v_proj.weight": [kv, hidden],
                prefix + "self_attn.o_proj.weight": [hidden, hidden],
                prefix + "mlp.gate_proj.weight": [self.intermediate, hidden],
                prefix + "mlp.up_proj.weight": [self.intermediate, hidden],
                prefix + "mlp.down_proj.weight": [hidden, self.intermediate],
                prefix + "input_layernorm.weight": [hidden],
                prefix + "post_attention_layernorm.weight": [hidden],
            }
        return shapes


_WRITE_WEIGHTS = """
import json, sys
import torch
from safetensors.torch import save_file
path, shapes, seed, dtype = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
generator = torch.Generator().manual_seed(seed)
tensors = {}
for name, shape in sorted(shapes.items()):
    if len(shape) == 1:
        value = torch.ones(shape)
    elif name == "model.embed_tokens.weight":
        value = torch.randn(shape, generator=generator)
    else:
        value = torch.randn(shape, generator=generator) / shape[1] ** 0.5
    tensors[name] = value.to(getattr(torch, dtype)).contiguous()
save_file(tensors, path)
"""


def prompt_ids(length: int, *, seed: int = 0, vocab: int = 1024) -> list[int]:
    """A deterministic prompt of `length` token ids, avoiding BOS/EOS (ids 1, 2) and 0."""
    return [3 + (seed * 7919 + i * 104729 + (i * i) % 97) % (vocab - 3) for i in range(length)]


#: The model of the PDTransferConnector tests (tests/e2e/test_vllm_pd_transfer.py,
#: test_vllm_faults.py): 4 layers, 2 KV heads; its weights come from seed 0, so one written
#: copy and one plain vLLM serving it (the reference) serve every module of the session.
TINY_LLAMA = ModelSpec(layers=4, kv_heads=2, hidden=256, heads=4)
#: Their chunked-prefill budget (`--max-num-batched-tokens`): longer prompts are prefilled in
#: chunks.
CHUNK_TOKENS = 256
