"""The spec and name cases the CRD's rules are judged by, shared by the unit tests (Python
checks and cel-python) and the integration test against a real CEL API server, so both
judge the very same table.

- `INVALID`: (case id, spec sections to merge into `factories.BASE_SPEC`, failing rule
  names, a fragment of the operator's message);
- `VALID`: (case id, spec sections) that every check accepts;
- `MIRRORED`: (spec sections, rule) for the other role's twin of a one-role rule;
- `CEL_TWIN_NAMES`: (metadata.name, root rules it breaks); `NON_DNS_1035_NAMES`: names a
  Service cannot carry; `NAME_44` / `NAME_45`: the longest accepted name and one longer.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CEL_TWIN_NAMES", "INVALID", "MIRRORED", "NAME_44", "NAME_45", "NON_DNS_1035_NAMES",
           "SGLANG", "VALID", "VLLM"]

Spec = dict[str, Any]

# The base spec runs vLLM (PDTransfer by default); SGLang runs only EngineNative.
VLLM: Spec = {"engine": {"framework": "vllm", "image": "vllm/vllm-openai:v0.32.0"}}
SGLANG: Spec = {"engine": {"framework": "sglang", "image": "lmsysorg/sglang:latest"}}

# (case id, spec sections to merge into the valid base, failing rule names, message fragment)
INVALID: list[tuple[str, Spec, set[str], str]] = [
    (
        "prefill-tp-not-fitting-heads",
        {"prefill": {"parallelism": {"tensor": 3}}},
        {"prefill-tp-fits-kv-heads"},
        "spec.prefill.parallelism: attention tensor parallelism 3 (tensor/data) must divide "
        "spec.model.numKVHeads (8) or be a multiple of it",
    ),
    (
        "decode-tp-not-fitting-heads",
        # 8 heads, decode TP 12: neither 8 % 12 nor 12 % 8 is zero.
        {"decode": {"parallelism": {"tensor": 12}}, "transfer": {"staging": {"mode": "Never"}}},
        {"decode-tp-fits-kv-heads"},
        "attention tensor parallelism 12 (tensor/data) must divide spec.model.numKVHeads (8)",
    ),
    (
        "data-not-dividing-tensor",
        {"prefill": {"parallelism": {"tensor": 4, "data": 3}}},
        {"prefill-data-divides-tensor"},
        "spec.prefill.parallelism.data (3) must divide spec.prefill.parallelism.tensor (4)",
    ),
    (
        "layers-not-divisible-by-pipeline",
        {"decode": {"parallelism": {"pipeline": 3}}},
        {"decode-pipeline-divides-layers"},
        "spec.model.numLayers (80) must be divisible by spec.decode.parallelism.pipeline (3)",
    ),
    (
        "gpus-below-ranks",
        {"prefill": {"gpusPerPod": 2, "parallelism": {"tensor": 2, "pipeline": 2}}},
        {"prefill-gpus-cover-ranks"},
        "spec.prefill.gpusPerPod (2) is less than tensor × pipeline (4)",
    ),
    (
        "page-sizes-differ",
        {"prefill": {"pageSize": 16}, "decode": {"pageSize": 32}},
        {"same-page-size"},
        "spec.prefill.pageSize (16) and spec.decode.pageSize (32) differ",
    ),
    (
        "mla-with-heads",
        {"model": {"attention": "MLA", "numKVHeads": 8}},
        {"mla-single-latent"},
        "spec.model.numKVHeads is 8 but attention is MLA",
    ),
    (
        "mla-with-staging",
        {"model": {"attention": "MLA", "numKVHeads": 1, "headDim": 576},
         "transfer": {"staging": {"mode": "Always"}}},
        {"mla-no-staging"},
        "spec.transfer.staging.mode is Always but MLA attention never uses staging",
    ),
    (
        # TP2 -> TP4, 8 heads: a decode rank holds 8/4 = 2 heads; one chunk is
        # 8192 tokens × 2 heads × 128 × 2 B × 2 × 80 layers = 671088640 B = 640 MiB.
        "decode-pool-too-small",
        {**VLLM, "prefill": {"parallelism": {"tensor": 2}},
         "decode": {"parallelism": {"tensor": 4}}, "transfer": {"staging": {"decodePoolMiB": 639}}},
        {"decode-pool-holds-chunk"},
        "spec.transfer.staging.decodePoolMiB (639) cannot hold one prefill chunk: 8192 tokens "
        "× 2 KV heads per decode rank × 128 head dim × 2 bytes × 2 (K and V) × 80 layers = "
        "671088640 bytes. Set decodePoolMiB to at least 640",
    ),
    (
        # TP2 -> TP4: a prefill rank holds 4 heads and sends all of them (2 per decode rank);
        # 8192 × 4 × 128 × 2 × 2 × 80 = 1342177280 B = 1280 MiB.
        "prefill-buffer-too-small",
        {**VLLM, "prefill": {"parallelism": {"tensor": 2}},
         "decode": {"parallelism": {"tensor": 4}},
         "transfer": {"staging": {"prefillBufferMiB": 1279}}},
        {"prefill-buffer-holds-chunk"},
        "Set prefillBufferMiB to at least 1280",
    ),
    (
        # 2 KV heads, TP4 -> TP8: decode ranks replicate heads, each needs 1 head; a prefill
        # rank (1 head) serves 8/4 = 2 decode ranks: 2 heads sent. 1000 tokens round up to
        # 63 pages of 16 = 1008 tokens; decode: 1008 × 1 × 128 × 1 B (fp8) × 2 × 80 =
        # 20643840 B = 19.7 MiB -> at least 20 MiB.
        "decode-pool-replicated-heads-fp8",
        {**VLLM, "model": {"numKVHeads": 2, "kvDtype": "fp8_e4m3"},
         "prefill": {"parallelism": {"tensor": 4}, "chunkedPrefillTokens": 1000},
         "decode": {"parallelism": {"tensor": 8}},
         "transfer": {"staging": {"decodePoolMiB": 19}}},
        {"decode-pool-holds-chunk"},
        "1008 tokens × 1 KV heads per decode rank × 128 head dim × 1 bytes × 2 (K and V) × "
        "80 layers = 20643840 bytes. Set decodePoolMiB to at least 20",
    ),
    (
        "backend-not-available",
        {**SGLANG, "transfer": {"backend": "PDTransfer"}},
        {"backend-supported"},
        "spec.transfer.backend PDTransfer is not available for spec.engine.framework sglang, "
        "which runs EngineNative. Set spec.transfer.backend to EngineNative or leave it out.",
    ),
    (
        # The staging patch a user tries on a deployment whose engine keeps its own connector.
        "engine-native-with-staging-sizes",
        {**VLLM, "transfer": {"backend": "EngineNative", "staging": {"decodePoolMiB": 6144}}},
        {"engine-native-has-no-staging-sizes"},
        "spec.transfer.staging.prefillBufferMiB and decodePoolMiB cannot be set with "
        "spec.transfer.backend EngineNative: the vllm engine's own KV connector moves the KV "
        "and has no staging pool to resize. Remove them, or set spec.transfer.backend to "
        "PDTransfer.",
    ),
    (
        "sglang-with-staging-sizes",
        {**SGLANG, "transfer": {"staging": {"prefillBufferMiB": 64}}},
        {"engine-native-has-no-staging-sizes"},
        "the sglang engine's own KV connector moves the KV and has no staging pool to resize. "
        "Remove them: sglang runs only EngineNative.",
    ),
    (
        "router-without-image",
        {"router": {"enabled": True}},
        {"router-image"},
        "spec.router.enabled is true but spec.router.image is not set",
    ),
    (
        "layer-groups-inverted",
        {"transfer": {"layerPipeline": {"minGroups": 9, "maxGroups": 4}}},
        {"layer-pipeline-groups-ordered"},
        "minGroups (9) is greater than maxGroups (4)",
    ),
]

VALID: list[tuple[str, Spec]] = [
    ("base", {}),
    ("equal-tp-no-staging-needed", {**VLLM, "transfer": {"staging": {"decodePoolMiB": 1}}}),
    ("staging-never-ignores-pool", {**VLLM, "prefill": {"parallelism": {"tensor": 2}},
                                    "decode": {"parallelism": {"tensor": 4}},
                                    "transfer": {"staging": {"mode": "Never",
                                                             "decodePoolMiB": 1}}}),
    ("pool-exactly-enough", {**VLLM, "prefill": {"parallelism": {"tensor": 2}},
                             "decode": {"parallelism": {"tensor": 4}},
                             "transfer": {"staging": {"decodePoolMiB": 640,
                                                      "prefillBufferMiB": 1280}}}),
    ("tp-multiple-of-heads", {"model": {"numKVHeads": 2},
                              "prefill": {"parallelism": {"tensor": 8}},
                              "decode": {"parallelism": {"tensor": 8}}}),
    ("dp-attention", {"decode": {"parallelism": {"tensor": 8, "data": 8}},
                      "prefill": {"parallelism": {"tensor": 1}}}),
    ("mla", {"model": {"attention": "MLA", "numKVHeads": 1, "headDim": 576},
             "prefill": {"parallelism": {"tensor": 8}},
             "decode": {"parallelism": {"tensor": 16}}}),
    ("router", {"router": {"enabled": True, "image": "lmsysorg/sglang:latest"}}),
    ("sglang", {**SGLANG, "prefill": {"parallelism": {"tensor": 2}},
                "decode": {"parallelism": {"tensor": 4}}}),
    ("vllm-default-pools-too-small-for-no-chunk", {**VLLM}),
    ("vllm-engine-native-default-pools", {**VLLM, "transfer": {"backend": "EngineNative"},
                                          "prefill": {"parallelism": {"tensor": 2}},
                                          "decode": {"parallelism": {"tensor": 4}}}),
    ("cpu-engine", {**VLLM, "prefill": {"gpusPerPod": 0, "parallelism": {"tensor": 2}}}),
]

# (spec sections to merge, the one rule it breaks): the twins of INVALID's one-role cases
MIRRORED: list[tuple[Spec, str]] = [
    ({"decode": {"parallelism": {"tensor": 4, "data": 3}}}, "decode-data-divides-tensor"),
    ({"prefill": {"parallelism": {"pipeline": 3}}}, "prefill-pipeline-divides-layers"),
    ({"decode": {"gpusPerPod": 1, "parallelism": {"tensor": 2}},
      "prefill": {"parallelism": {"tensor": 2}}}, "decode-gpus-cover-ranks"),
]

NAME_44 = "a" * 38 + "-llama"  # 44 characters
NAME_45 = "b" + NAME_44

CEL_TWIN_NAMES: list[tuple[str, set[str]]] = [
    (NAME_44, set()),
    ("x", set()),
    ("llama-70b", set()),
    (NAME_45, {"name-fits-child-names"}),
    ("d" * 63, {"name-fits-child-names"}),
    ("Llama", {"name-is-dns-1035-label"}),
    ("llama.v1", {"name-is-dns-1035-label"}),
    ("9llama", {"name-is-dns-1035-label"}),
]

# Uppercase, dots, a leading digit, edge dashes, underscores.
NON_DNS_1035_NAMES = ["Llama", "llama.v1", "1llama", "llama-", "-llama", "ll_ama"]
