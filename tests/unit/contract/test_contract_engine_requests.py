"""`TransferAgentStatus.engineRequests`: the requests a pod's engine is running or holding
waiting, which the operator's scale-down choice reads. Its wire name, that it is never
negative, and that "not read" is absent on the wire (and listed in status.unknown by the
agents), never 0. Needs neither NIXL nor a GPU."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pd_contract.transferagent import TransferAgentStatus


def test_engine_requests_travel_as_engine_requests_and_are_absent_when_unread() -> None:
    status = TransferAgentStatus.model_validate({"engineRequests": 7, "liveRequests": 2})
    assert (status.engine_requests, status.live_requests) == (7, 2)
    assert status.to_wire()["engineRequests"] == 7
    assert TransferAgentStatus.model_validate({"engineRequests": 0}).to_wire()[
        "engineRequests"] == 0  # an idle engine is measured: 0 is written
    unread = TransferAgentStatus(unknown=["engineRequests"])
    assert unread.engine_requests is None
    assert "engineRequests" not in unread.to_wire()


def test_engine_requests_are_never_negative() -> None:
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        TransferAgentStatus.model_validate({"engineRequests": -1})
    schema = TransferAgentStatus.model_json_schema(by_alias=True)["properties"]
    assert schema["engineRequests"]["anyOf"][0] == {"minimum": 0, "type": "integer"}
