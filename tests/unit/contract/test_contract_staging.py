"""`AgentStaging`, the one shape of a staging size: a role's size in MiB and in bytes, worked
out by hand; a frozen value with its wire form unchanged; and the two boundaries that keep
their own types (the ConfigMap's `StagingConfig`, the CRD's `Staging`) converting to the same
sizes. Needs neither NIXL nor a GPU."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pd_contract.config import StagingConfig
from pd_contract.transferagent import BYTES_PER_MIB, AgentStaging, Role
from pd_operator.api.transfer_spec import Staging
from pd_operator.build.config import build_transfer_config
from pd_testbed.factories import make_pdd

SIZES = AgentStaging(decode_pool_mib=8, prefill_buffer_mib=3)


def test_a_roles_size_in_mib_and_in_bytes() -> None:
    """A decode pod allocates its ring (decodePoolMiB), a prefill pod its buffer
    (prefillBufferMiB). Guards against a role reading the other role's size, and against a
    MiB → bytes conversion that is not 2**20 (1000 × 1000, or a shift by 10)."""
    assert SIZES.mib_for(Role.DECODE) == 8
    assert SIZES.bytes_for(Role.DECODE) == 8_388_608  # 8 × 1024 × 1024
    assert SIZES.mib_for(Role.PREFILL) == 3
    assert SIZES.bytes_for(Role.PREFILL) == 3_145_728  # 3 × 1024 × 1024
    assert BYTES_PER_MIB == 1_048_576  # 1024 × 1024
    # The CRD's largest size (1048576 MiB) is 1 TiB: 2**20 × 2**20 = 2**40 bytes.
    largest = AgentStaging(decode_pool_mib=1_048_576, prefill_buffer_mib=1)
    assert largest.bytes_for(Role.DECODE) == 1_099_511_627_776
    assert largest.bytes_for(Role.PREFILL) == 1_048_576


def test_a_role_named_by_its_wire_string_answers_alike_and_no_other_name_does() -> None:
    """Agents hold their role as the downward API's string. Guards against an unknown role
    silently getting the prefill buffer (the old `decode if … else prefill` fallback)."""
    assert SIZES.mib_for(Role("decode")) == 8 and SIZES.mib_for(Role("prefill")) == 3
    with pytest.raises(ValueError, match="router"):
        SIZES.mib_for("router")  # type: ignore[arg-type]


def test_a_size_is_a_frozen_hashable_value_with_its_wire_form_unchanged() -> None:
    """The rollout counts and compares sizes (equal sizes are one key) and never edits one
    in place. Guards against a size changing under a TransferAgent spec that holds it."""
    same = AgentStaging.model_validate({"decodePoolMiB": 8, "prefillBufferMiB": 3})
    assert same == SIZES and hash(same) == hash(SIZES) and len({same, SIZES}) == 1
    swapped = AgentStaging(decode_pool_mib=3, prefill_buffer_mib=8)
    assert swapped != SIZES and swapped.mib_for(Role.DECODE) == 3
    assert SIZES.to_wire() == {"decodePoolMiB": 8, "prefillBufferMiB": 3}
    assert str(SIZES) == "decodePoolMiB=8/prefillBufferMiB=3"
    with pytest.raises(ValidationError):
        SIZES.decode_pool_mib = 16  # type: ignore[misc]
    assert SIZES.decode_pool_mib == 8
    with pytest.raises(ValidationError):
        AgentStaging(decode_pool_mib=0, prefill_buffer_mib=3)


def test_the_configmap_and_the_crd_convert_to_the_same_sizes_at_their_boundary() -> None:
    """The pod's config file keeps its own field names and the CRD its own type; each
    converts once (`sizes`). Guards against the sizes a pod starts with (the ConfigMap) and
    the sizes the operator rolls out (the CRD) swapping or dropping a field on the way."""
    config = StagingConfig(mode="Always", prefill_buffer_mib=3, decode_pool_mib=8)
    assert config.sizes == SIZES
    assert config.model_dump() == {"mode": "Always", "prefill_buffer_mib": 3,
                                   "decode_pool_mib": 8}  # the file's form, unchanged
    assert Staging.model_validate({"decodePoolMiB": 8, "prefillBufferMiB": 3}).sizes == SIZES
    # The operator renders the CRD's sizes into the ConfigMap (sizes that hold a chunk).
    pdd = make_pdd(transfer={"staging": {"mode": "Always", "decodePoolMiB": 6144,
                                         "prefillBufferMiB": 3072}})
    rendered = build_transfer_config(pdd).staging
    assert (rendered.decode_pool_mib, rendered.prefill_buffer_mib) == (6144, 3072)
    assert rendered.sizes == pdd.spec.transfer.staging.sizes == AgentStaging(
        decode_pool_mib=6144, prefill_buffer_mib=3072)
