"""``pd-transfer engine`` argument parsing; nothing heavy is imported until it runs."""

from __future__ import annotations

import argparse
import os

from pd_contract.names import ENV_TRANSFER_CONFIG

__all__ = ["add_engine_parser"]


def _run(args: argparse.Namespace) -> int:
    from pd_transfer.reference.engine.main import run_engine  # noqa: PLC0415 - torch/NIXL load here

    return run_engine(args)


def add_engine_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "engine",
        help="run the reference engine of one pod (framework: reference) with its agent",
        description="A small reference model, KV pools per TP rank, the NIXL sender or "
        "receiver with bootstrap servers, an HTTP API and the agent that reports into the "
        "pod's TransferAgent. Reads the pod's identity from the downward-API environment.",
    )
    add = parser.add_argument
    add("--role", choices=["prefill", "decode"], required=True)
    add("--config", default=os.environ.get(ENV_TRANSFER_CONFIG, ""),
        required=ENV_TRANSFER_CONFIG not in os.environ,
        help=f"transfer config JSON (default: ${ENV_TRANSFER_CONFIG})")
    add("--port", type=int, required=True, help="HTTP API port")
    add("--num-pages", type=int, default=int(os.environ.get("PD_ENGINE_NUM_PAGES", "512")),
        help="KV pages per rank (default: $PD_ENGINE_NUM_PAGES or 512)")
    add("--q-heads-per-kv", type=int,
        default=int(os.environ.get("PD_ENGINE_Q_HEADS_PER_KV", "2")),
        help="query heads per KV head of the reference model (default 2)")
    add("--seed", type=int, default=0)
    parser.set_defaults(handler=_run)
