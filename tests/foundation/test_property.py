"""Property: tasks == distinct (tenant, key) whose first call was valid; replays equal the first."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox import Outbox, errors
from tests.foundation.conftest import counts

TENANTS = ["acme", "globex"]
KEYS = ["k1", "k2", "k3"]
ARGUMENTS = [
    {"subject": "Late parcel"},
    {"subject": "Late parcel", "priority": "high"},
    {"subject": "Broken lid", "helpdesk": False},
    {"subject": ""},  # invalid
    {"subject": "ok", "priority": "urgent"},  # invalid
]

_examples = itertools.count()

calls = st.lists(
    st.tuples(st.sampled_from(TENANTS), st.sampled_from(KEYS), st.integers(0, len(ARGUMENTS) - 1)),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(sequence=calls)
def test_tasks_match_distinct_valid_first_calls(db_url, clock, sequence):
    with Outbox(db_url, clock=clock) as box:
        for tenant in TENANTS:
            box.create_tenant(tenant)
        # Hypothesis reuses the database across examples: namespace keys per example.
        prefix = f"ex{next(_examples)}-"
        first: dict[tuple[str, str], tuple[int, str | None]] = {}
        before = counts(box)["tasks"]
        for tenant, key, index in sequence:
            operation_id = prefix + key
            try:
                result = box.execute(tenant, operation_id, "create_support_task", ARGUMENTS[index])
            except errors.InvalidArguments:
                continue
            except errors.IdempotencyKeyReused:
                assert (tenant, key) in first and first[(tenant, key)][0] != index
                continue
            if (tenant, key) in first:
                assert result.replayed and result.receipt_json == first[(tenant, key)][1]
            else:
                assert result.created
                first[(tenant, key)] = (index, result.receipt_json)
        assert counts(box)["tasks"] - before == len(first)
