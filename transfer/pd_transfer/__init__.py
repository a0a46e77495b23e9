"""pd-transfer: moves KV cache from prefill to decode ranks over NIXL."""

__version__ = "0.1.0"
