"""What a prefill rank and a decode rank share (``pd_transfer.prefill``, ``pd_transfer.decode``).

- ``types``: what an endpoint is built from and answers with (``RankIdentity``,
  ``Timeouts``, ``PollIntervals``, ``CUDA_POLL``, ``ResizeResult``);
- ``transfer``: ``Transfer``, what every request has on either side for its lifetime;
- ``core``: ``Endpoint``, the worker-driven core (commands, authenticated message intake
  against one direction table, peers, admission and endings of a ``Transfer``);
- ``frames``: ``PeerFrames``, the frames its messages travel in, sealed per peer pair where
  pods have identities;
- ``statuses``: ``StatusBoard``, the request statuses engine threads poll;
- ``memory``: ``StagingMemory``, a side's registered staging memory and its swap;
- ``resize``: ``StagingResizes``, the drain → swap lifecycle of a staging resize.
"""

from pd_transfer.endpoint.core import Endpoint
from pd_transfer.endpoint.memory import StagingMemory
from pd_transfer.endpoint.resize import StagingSide
from pd_transfer.endpoint.transfer import Transfer
from pd_transfer.endpoint.types import (
    CUDA_POLL,
    PollIntervals,
    RankIdentity,
    ResizeResult,
    Timeouts,
)

__all__ = ["CUDA_POLL", "Endpoint", "PollIntervals", "RankIdentity", "ResizeResult",
           "StagingMemory", "StagingSide", "Timeouts", "Transfer"]
