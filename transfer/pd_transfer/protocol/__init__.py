"""The transfer protocol as data: wire messages (``messages``), request lifecycles
(``lifecycle``), part states of the grant/write protocol (``parts``) and the router↔engine
request contract (``handoff``: the ``kv_transfer_params`` the router builds and the vLLM
connector reads). No I/O and no transport import here; ``sender``/``decode`` drive it."""

from pd_transfer.protocol.lifecycle import (
    TERMINAL,
    TRANSITIONS,
    Event,
    FailureReason,
    Lifecycle,
    RequestStatus,
    Role,
    State,
)
from pd_transfer.protocol.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Message,
    decode_message,
    encode_message,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "TERMINAL",
    "TRANSITIONS",
    "Event",
    "FailureReason",
    "Lifecycle",
    "Message",
    "RequestStatus",
    "Role",
    "State",
    "decode_message",
    "encode_message",
]
