"""Fault plans: scripts before rates, seeded and reproducible, validated."""

from __future__ import annotations

from collections import Counter

import pytest

from fake_provider import ConfigError, FaultPlan, FaultSpec, FaultSpecError, Outcome, ProviderConfig

from .conftest import AppFactory, open_client, ticket_body

RATES = {
    Outcome.FAIL_AFTER_COMMIT: 0.1,
    Outcome.DROP_AFTER_COMMIT: 0.1,
    Outcome.RATE_LIMIT: 0.1,
    Outcome.FAIL_BEFORE_COMMIT: 0.1,
}


def outcomes(plan: FaultPlan, n: int) -> list[Outcome]:
    return [plan.decide().outcome for _ in range(n)]


def test_same_seed_same_sequence() -> None:
    spec = FaultSpec(rates=RATES, latency_min_ms=0, latency_max_ms=100)
    first = [FaultPlan(spec, seed=42).decide() for _ in range(1)]
    a, b = FaultPlan(spec, seed=42), FaultPlan(spec, seed=42)
    runs = [[a.decide() for _ in range(200)], [b.decide() for _ in range(200)]]
    assert runs[0] == runs[1]
    assert runs[0][0] == first[0]
    assert len({d.outcome for d in runs[0]}) == 5  # the four faults and ok all occur
    assert len({d.latency_ms for d in runs[0]}) > 10


def test_other_seed_other_sequence() -> None:
    spec = FaultSpec(rates=RATES)
    assert outcomes(FaultPlan(spec, seed=1), 50) != outcomes(FaultPlan(spec, seed=2), 50)


def test_rate_order_does_not_change_the_sequence() -> None:
    reversed_rates = dict(reversed(list(RATES.items())))
    assert outcomes(FaultPlan(FaultSpec(rates=RATES), seed=3), 100) == outcomes(
        FaultPlan(FaultSpec(rates=reversed_rates), seed=3), 100
    )


def test_rates_are_roughly_honoured() -> None:
    counts = Counter(outcomes(FaultPlan(FaultSpec(rates=RATES), seed=5), 10_000))
    for outcome in RATES:
        assert 850 < counts[outcome] < 1150
    assert 5700 < counts[Outcome.OK] < 6300


def test_script_comes_first_and_does_not_shift_the_random_tail() -> None:
    script = (Outcome.REJECT, Outcome.UNAVAILABLE, Outcome.OK)
    scripted = FaultPlan(FaultSpec(rates=RATES, script=script), seed=9)
    unscripted = FaultPlan(FaultSpec(rates=RATES), seed=9)
    decisions = [scripted.decide() for _ in range(30)]
    assert [d.outcome for d in decisions[:3]] == list(script)
    assert [d.scripted for d in decisions[:4]] == [True, True, True, False]
    assert [d.outcome for d in decisions[3:]] == outcomes(unscripted, 30)[3:]


def test_latency_stays_in_range() -> None:
    plan = FaultPlan(FaultSpec(latency_min_ms=5, latency_max_ms=8), seed=0)
    assert {plan.decide().latency_ms for _ in range(500)} == {5, 6, 7, 8}


def test_reseeding_restarts_the_sequence_and_counts_accumulate() -> None:
    plan = FaultPlan(FaultSpec(rates=RATES), seed=11)
    first = outcomes(plan, 20)
    plan.replace(FaultSpec(rates=RATES), seed=11)
    assert outcomes(plan, 20) == first
    assert sum(plan.counts().values()) == 40
    plan.reset_counts()
    assert set(plan.counts().values()) == {0}


def test_unseeded_plans_report_their_seed() -> None:
    plan = FaultPlan(FaultSpec(rates=RATES))
    replay = FaultPlan(FaultSpec(rates=RATES), seed=plan.seed)
    assert outcomes(plan, 50) == outcomes(replay, 50)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (FaultSpec(rates={Outcome.OK: 0.5}), "rates"),
        (FaultSpec(rates={Outcome.REJECT: 1.5}), "rates.reject"),
        (FaultSpec(rates={Outcome.REJECT: 0.6, Outcome.RATE_LIMIT: 0.6}), "sum to 1.2"),
        (FaultSpec(latency_min_ms=-1), "latency_ms.min"),
        (FaultSpec(latency_min_ms=3, latency_max_ms=2), "latency_ms.max"),
    ],
)
def test_invalid_specs_name_the_field(spec: FaultSpec, field: str) -> None:
    with pytest.raises(FaultSpecError, match=field):
        spec.validate()
    with pytest.raises(ConfigError, match=field):
        ProviderConfig(faults=spec).validate()


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (ProviderConfig(lookup_lag_ms=-1), "lookup_lag_ms"),
        (ProviderConfig(key_retention_seconds=0), "key_retention_seconds"),
        (ProviderConfig(hold_seconds=-1), "hold_seconds"),
        (ProviderConfig(retry_after_seconds=-1), "retry_after_seconds"),
    ],
)
def test_invalid_configs_name_the_field(config: ProviderConfig, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        config.validate()


@pytest.mark.anyio
async def test_seeded_providers_give_the_same_replies(make_app: AppFactory, transport: str) -> None:
    """Two providers with one seed answer the same sequence of requests identically."""
    runs = []
    for _ in range(2):
        app = make_app(
            seed=1234,
            faults=FaultSpec(
                rates={
                    Outcome.FAIL_BEFORE_COMMIT: 0.15,
                    Outcome.FAIL_AFTER_COMMIT: 0.15,
                    Outcome.RATE_LIMIT: 0.15,
                    Outcome.UNAVAILABLE: 0.15,
                    Outcome.REJECT: 0.1,
                }
            ),
        )
        async with open_client(app, transport) as client:
            statuses = [
                (await client.post("/v1/tickets", json=ticket_body(f"r{i}"))).status_code
                for i in range(40)
            ]
            stats = (await client.get("/_admin/stats")).json()
        runs.append(
            (statuses, stats["requests"], [t.client_reference for t in app.state.ledger.tickets()])
        )
    assert runs[0] == runs[1]
    assert len(set(runs[0][0])) == 5  # 201, 500, 429, 503, 400 all occurred
