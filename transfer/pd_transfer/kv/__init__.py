"""The KV cache's geometry and memory, with no protocol and no peer in sight.

Bottom up: ``layout`` (page formats and byte arithmetic), ``pool`` (``KVPool``: the pool's
memory and registration ranges), ``plan`` (which prefill rank sends which heads and layers to
which decode rank), ``ring`` (decode's staging ring bookkeeping), ``staging_kernel`` (the
fused Triton gather/scatter) and ``staging`` (gathers and scatters of head slices, on either
device), ``pipeline`` (a prefill forward's layer groups and the pages each chunk sends).

Nothing here imports a transport, a message or an endpoint; each module is imported by its
own path (``pd_transfer.kv.layout``), so this package's import loads nothing.
"""
