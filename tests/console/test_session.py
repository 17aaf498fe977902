"""Session cookies and CSRF tokens, without a browser."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from reconciler.console import session
from reconciler.console.routes import _safe_next

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
SHA = "a" * 64


def test_a_session_reads_back_until_it_expires() -> None:
    signer = session.Signer(b"k" * 32, duration=timedelta(hours=1))
    value = signer.issue(SHA, "Alice", NOW)
    found = signer.read(value, NOW + timedelta(minutes=59))
    assert found is not None and (found.token_sha256, found.name) == (SHA, "Alice")
    assert signer.read(value, NOW + timedelta(hours=1)) is None


def test_a_forged_or_foreign_session_is_refused() -> None:
    signer = session.Signer(b"k" * 32)
    value = signer.issue(SHA, "Alice", NOW)
    payload, signature = value.split(".")
    assert signer.read(f"{payload}x.{signature}", NOW) is None
    # Change the signature's last character (to one it is not: the signature
    # covers a random nonce, so it ends in "A" one time in 64).
    other = "B" if signature.endswith("A") else "A"
    assert signer.read(f"{payload}.{signature[:-1]}{other}", NOW) is None
    assert signer.read("garbage", NOW) is None
    assert session.Signer(b"j" * 32).read(value, NOW) is None  # another process's secret


def test_csrf_tokens_belong_to_one_session() -> None:
    signer = session.Signer(b"k" * 32)
    one = signer.read(signer.issue(SHA, "", NOW), NOW)
    two = signer.read(signer.issue(SHA, "", NOW), NOW)
    assert one is not None and two is not None
    assert signer.check_csrf(one, signer.csrf(one))
    assert not signer.check_csrf(one, signer.csrf(two))  # same token, other sign-in
    assert not signer.check_csrf(one, None)
    assert not signer.check_csrf(one, "")
    nonce = signer.sign_in_nonce()
    assert signer.check_sign_in_csrf(nonce, signer.sign_in_csrf(nonce))
    assert not signer.check_sign_in_csrf(None, signer.sign_in_csrf(nonce))


def test_sign_in_returns_only_to_console_pages() -> None:
    assert _safe_next("/console/items/3?done=x") == "/console/items/3?done=x"
    for target in (None, "", "https://evil.example/", "//evil.example/console/", "/v1/review"):
        assert _safe_next(target) == "/console/queue"
    assert _safe_next("/console/\\evil") == "/console/queue"
