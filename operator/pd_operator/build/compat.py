"""The KV-compatibility key: what must be equal between a prefill pod and a decode pod for
KV computed by one to be used by the other.

Its inputs are the spec fields that decide the KV's bytes and meaning:
- the model (name and source: other weights give other KV for the same tokens), its layer
  and KV-head geometry, head width, KV dtype and attention kind;
- the page size;
- the engine framework and image: the image carries the engine version and the transfer
  module's wire version;
- the transfer backend, and whether its pods prove who they are with identities of their own
  (docs/failure-modes.md #59): a pod with an identity accepts only peers with one.

Replica counts, parallelism, resources, engine arguments and environment, staging sizes,
the router and placement are not inputs: a change of them leaves the KV exchangeable. An
engine argument that changes the KV's meaning (a quantization, a model revision given as
an argument) therefore does not move the key; change the model's `source` or the image
with it.

The key is the first 16 hex digits of a SHA-256 over the inputs' canonical JSON. It is a
label value, `pd.serving.dev/kv-compat`, on both roles' pods, and the router pairs a
prefill only with a decode of the same key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

from pd_operator.api.resources import PDDeployment
from pd_operator.engines import runs_pd_transfer

__all__ = ["KV_COMPAT_DIGITS", "kv_compat_inputs", "kv_compat_key"]

KV_COMPAT_DIGITS: Final = 16


def kv_compat_inputs(pdd: PDDeployment) -> dict[str, Any]:
    """The fields the key is derived from, by name (shown as they are in the spec)."""
    spec = pdd.spec
    model = spec.model
    return {
        "model": {"name": model.name, "source": model.source, "numLayers": model.num_layers,
                  "numKVHeads": model.num_kv_heads, "headDim": model.head_dim,
                  "kvDtype": model.kv_dtype.value, "attention": model.attention.value},
        "pageSize": spec.decode.page_size,
        "engine": {"framework": spec.engine.framework.value, "image": spec.engine.image},
        "transferBackend": spec.transfer_backend.value,
        **({"transferIdentity": "pod"} if runs_pd_transfer(pdd) else {}),
    }


def kv_compat_key(pdd: PDDeployment) -> str:
    """The deployment's KV-compatibility key (a valid label value)."""
    canonical = json.dumps(kv_compat_inputs(pdd), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:KV_COMPAT_DIGITS]
