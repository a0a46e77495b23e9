"""The prefill side: ``PrefillSender`` pushes a request's KV into the decode ranks that ask.

Engine API (any thread; each call returns a Future resolved on the worker thread):
``register_request(room, page_ids, num_tokens, decode_instance=)`` → ``send_part(room,
pages=, layers=, last=, ready_event=)`` (one or more; ``last=True`` on the final one) →
``poll(room)`` until ``finished``; ``abort(room)``. The engine may free a request's KV
pages once its status is finished (either way): nothing reads them after that.
``resize(staging, deadline_s)`` (``Endpoint``'s, both sides') re-sizes this rank's staging
buffer in place to the ``AgentStaging``'s prefill buffer size.

One ``SendTransfer`` per request owns all of its state; it SUCCEEDS when every decode rank
it serves has sent RequestKV, the last part was given, every WRITE is DONE and every decode
rank sent ``Release`` (it scattered everything).

Files, in reading order (each module's docstring says its part of the protocol):

- ``sender.py``: ``PrefillSender``, the endpoint: engine API, commands, message dispatch,
  the per-step progress and the staging-buffer resize hooks.
- ``transfer.py``: per-request state: ``SendTransfer``, its streams and parts.
- ``context.py``: ``SenderContext``, what the collaborators below use of the endpoint.
- ``streams.py``: decode's RequestKV, early or not, checked and opened as a stream.
- ``parts.py``: parts made per decode rank, their staging space, pre-grants and grants.
- ``gathers.py``: gathers on the engine's thread and the pre-grant arming behind them.
- ``posting.py``: posting WRITEs and polling them to DONE.
- ``endings.py``: deadlines, re-notification and release.
- ``buffer.py``: the staging buffer in force, and its swap on a resize.
"""

from pd_transfer.prefill.sender import PrefillSender
from pd_transfer.prefill.transfer import DecodeBinding, ReadyEvent, SendTransfer

__all__ = ["DecodeBinding", "PrefillSender", "ReadyEvent", "SendTransfer"]
