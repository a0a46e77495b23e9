"""The frames an endpoint's control messages travel in, peer by peer (docs/failure-modes.md
#26, #59).

Without pod identities every frame is sealed with the deployment's transfer key. With them,
each peer gets the sealer of this pod's pair with the peer's (``PeerAuth.pair``), made when
the peer's checked document is connected (its credential checked once more here, since a
caller may hand a document that did not come through ``fetch_document``) and dropped with the
peer; a frame from an agent without one is ``unknown_peer``.
"""

from __future__ import annotations

from pd_contract.identity import PodIdentity
from pd_transfer.errors import RemoteProtocolError, TransportError
from pd_transfer.protocol.messages import PROTOCOL_VERSION, Message, RingUpdate, encode_message
from pd_transfer.trust.auth import PeerAuth, Purpose, Unauthenticated
from pd_transfer.trust.bootstrap import RankDocument

__all__ = ["PeerFrames"]


class PeerFrames:
    """Seals and opens one endpoint's message frames (module docstring); worker thread."""

    def __init__(self, auth: PeerAuth, identity: PodIdentity | None, agent_name: str) -> None:
        self._auth = auth
        self._identity = identity
        self._me = agent_name
        self._pairs: dict[str, PeerAuth] = {}

    def seal(self, peer: str, message: Message) -> bytes:
        """``message`` framed for ``peer`` (a RingUpdate, which carries transport secrets,
        encrypted)."""
        return self._framer(peer).seal(
            encode_message(message), purpose=Purpose.MESSAGE, version=PROTOCOL_VERSION,
            sender=self._me, receiver=peer, confidential=isinstance(message, RingUpdate))

    def open(self, peer: str, payload: bytes) -> bytes:
        """The body of a frame ``peer`` sealed for this agent; RemoteProtocolError else."""
        return self._framer(peer).open(payload, purpose=Purpose.MESSAGE,
                                       version=PROTOCOL_VERSION, sender=peer,
                                       receiver=self._me)

    def pair_with(self, document: RankDocument) -> PeerAuth | None:
        """The sealer of this pod's pair with ``document``'s (None without identities);
        TransportError when its credential does not hold. Kept by ``add``."""
        if self._identity is None:
            return None
        try:
            credential = self._auth.verify_peer(
                document.credential, role=document.role, instance=document.instance,
                what=f"peer {document.agent_name!r}")
            assert credential is not None  # this side has identities
            return self._auth.pair(self._identity, credential)
        except Unauthenticated as exc:
            raise TransportError(exc.detail) from exc

    def add(self, peer: str, sealer: PeerAuth | None) -> None:
        if sealer is not None:
            self._pairs[peer] = sealer

    def drop(self, peer: str) -> None:
        self._pairs.pop(peer, None)

    def _framer(self, peer: str) -> PeerAuth:
        if self._identity is None:
            return self._auth
        framer = self._pairs.get(peer)
        if framer is None:
            raise RemoteProtocolError("unknown_peer", f"{peer}: no checked document, so no "
                                      f"key of the pair yet")
        return framer
