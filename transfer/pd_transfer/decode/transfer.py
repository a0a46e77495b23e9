"""One request on one decode rank: ``ReceiveTransfer``, its writers (``_Writer``) and their
parts (``_InPart``).

Per expected writer (a prefill rank, by sender id) the request keeps its plan and path, its
final part count once known, and its parts, each in one ``PartState`` (Queued, Granted,
Scattering, Arrived: protocol/parts.py; a granted part holds its ring region). A part's state
changes only through the endpoint's ``PartMachine`` (``_Writer.move``). No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pd_transfer.common.paths import PathMode
from pd_transfer.endpoint import Transfer
from pd_transfer.kv.layout import KVLayout
from pd_transfer.kv.plan import TransferPlan
from pd_transfer.kv.staging import PageIds, PreparedMove
from pd_transfer.protocol.coverage import Coverage
from pd_transfer.protocol.lifecycle import Role
from pd_transfer.protocol.parts import Part, PartEvent, PartMachine, PartState

__all__ = ["ReceiveTransfer"]


@dataclass(kw_only=True, eq=False)
class _InPart(Part):
    """One part coming from one writer (``region``: its granted ring region)."""

    side: Role = Role.DECODE
    granted_at: float = 0.0
    ring_version: int = 0  # of the ring its region was granted in
    scattered: torch.cuda.Event | None = None  # CUDA: fires when its scatter has finished
    pregranted: bool = False  # its region went out with the RequestKV (decode/__init__.py)
    prepared: PreparedMove | None = None  # a pre-grant's scatter of the whole share
    withdraw_sent_at: float | None = None  # asked for the pre-grant back (resize, queued part)
    stamps: dict[str, float] = field(default_factory=dict)  # Stamp -> clock (phases.py)


@dataclass
class _Writer:
    """One prefill rank writing into this decode rank for one request."""

    peer: str
    plan: TransferPlan
    layout: KVLayout  # the writer's local layout
    path: str
    asked_at: float
    coverage: Coverage  # the plan's layers × the request's pages its landed parts claimed
    heard: bool = False
    final: int | None = None
    parts: dict[int, _InPart] = field(default_factory=dict)  # every part a message named

    def part(self, index: int) -> _InPart:
        """Part ``index``; an Unseen one (not kept until it takes an event) if none yet."""
        part = self.parts.get(index)
        return part if part is not None else _InPart(index=index)

    def in_state(self, *states: PartState) -> list[_InPart]:
        return [p for p in self.parts.values() if p.state in states]

    def arrived(self) -> list[int]:
        return sorted(p.index for p in self.in_state(PartState.ARRIVED))

    def move(self, part: _InPart, event: PartEvent, machine: PartMachine) -> None:
        """``event`` for ``part`` through the part-state table; the writer keeps the part."""
        machine.apply(part, event)
        self.parts[part.index] = part


class ReceiveTransfer(Transfer):
    """All state of one request on one decode rank (see module docstring).

    ``release(transfer)`` runs once, when the request reaches a terminal state (the
    receiver frees or quarantines what its parts hold)."""

    role = Role.DECODE

    def __init__(
        self,
        room: str,
        ticket: int,
        created: float,
        release: Callable[[ReceiveTransfer], None],
        *,
        bootstrap_s: float,
        dst_pages: list[int],
        num_tokens: int,
        instance: str | None,
        mode: PathMode,
        first_page: int = 0,
    ) -> None:
        super().__init__(room, created, lambda: release(self))
        self.ticket = ticket  # this incarnation's number; every message about it carries it
        self.dst_pages = dst_pages
        self.dst_ids: PageIds | None = None  # dst_pages on the device (staged path)
        self.num_tokens = num_tokens
        self.first_page = first_page
        self.instance = instance
        self.mode = mode
        self.bootstrap_deadline = self.created + bootstrap_s
        self.writers: dict[int, _Writer] = {}

    @property
    def pages(self) -> int:
        return len(self.dst_pages)

    def bound_peers(self) -> dict[str, int]:
        return {writer.peer: self.ticket for writer in self.writers.values()}

    def add_writer(self, peer: str, plan: TransferPlan, layout: KVLayout, path: str,
                   asked_at: float) -> _Writer:
        """Expect ``plan``'s share of this request from ``peer`` (``layout``: its pool's)."""
        coverage = Coverage(range(plan.layers.start, plan.layers.stop), len(self.dst_pages))
        writer = self.writers[plan.sender_id] = _Writer(peer, plan, layout, path, asked_at,
                                                        coverage)
        return writer

    def share_ranges(self, writer: _Writer) -> tuple[range, range]:
        """``writer``'s whole share of the request: its plan's layers × every page."""
        return (range(writer.plan.layers.start, writer.plan.layers.stop),
                range(len(self.dst_pages)))

    def holds_staging(self) -> bool:
        """A part holds a ring region (granted, or its scatter reads it)."""
        return any(w.in_state(PartState.GRANTED, PartState.SCATTERING)
                   for w in self.writers.values())
