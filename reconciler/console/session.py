"""Console sessions and CSRF tokens: signed values, nothing stored server-side.

The session cookie never holds the token. It holds the token's SHA-256 (the
value ``api_tokens`` stores anyway), the name the operator signed in with, an
expiry and a random nonce, signed with HMAC-SHA256 under a secret that lives
only in this process. So:

- JavaScript cannot read it (``HttpOnly``), other sites cannot send it
  (``SameSite=Strict``), and a leaked cookie is not a bearer token for the API;
- it dies at its expiry, and with the process (a restart signs everyone out);
- the token behind it is looked up again on every request, so revoking the
  token ends the session at the next click.

A CSRF token is the HMAC of the session's signature under the same secret: one
per session, checked in constant time on every POST. The sign-in form has no
session yet, so it is bound to a short-lived pre-session cookie instead.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

SESSION_COOKIE = "outbox_console"
SIGN_IN_COOKIE = "outbox_console_sign_in"
COOKIE_PATH = "/console"
SESSION_DURATION_DEFAULT = timedelta(hours=8)
SIGN_IN_WINDOW = timedelta(hours=1)
NAME_MAX = 100


class Ended(StrEnum):
    """Why a request carries no valid session; the sign-in page says which."""

    MISSING = "missing"  # never signed in here, or signed out
    NOT_OURS = "restarted"  # signed by another process: the console restarted (or it was altered)
    UNREADABLE = "unreadable"  # not a session cookie at all
    EXPIRED = "expired"  # past its expiry
    REVOKED = "revoked"  # the token behind it was revoked (or is no operator token any more)


ENDED_MESSAGES = {
    Ended.NOT_OURS: (
        "Your session ended because the console restarted since you signed in "
        "(sessions live only as long as the process). Sign in again to continue."
    ),
    Ended.UNREADABLE: "Your session cookie could not be read. Sign in again to continue.",
    Ended.EXPIRED: "Your session expired. Sign in again to continue.",
    Ended.REVOKED: (
        "The token you signed in with was revoked, so its session ended. "
        "Sign in with a current operator token."
    ),
}


@dataclass(frozen=True, slots=True)
class Session:
    """What a valid session cookie says."""

    token_sha256: str
    name: str
    expires_at: datetime
    signature: str  # identifies the session; the CSRF token is derived from it


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    """Signs and checks session cookies and CSRF tokens with one per-process secret."""

    def __init__(
        self, secret: bytes | None = None, *, duration: timedelta = SESSION_DURATION_DEFAULT
    ) -> None:
        self._secret = secret or secrets.token_bytes(32)
        self.duration = duration

    def _mac(self, purpose: str, data: str) -> str:
        message = f"{purpose}\x00{data}".encode()
        return _b64(hmac.new(self._secret, message, hashlib.sha256).digest())

    # --- the session -------------------------------------------------------------

    def issue(self, token_sha256: str, name: str, now: datetime) -> str:
        """A cookie value for a freshly authenticated operator token."""
        body = {
            "h": token_sha256,
            "n": name[:NAME_MAX],
            "e": int((now + self.duration).timestamp()),
            "r": secrets.token_hex(8),  # two sign-ins never share a CSRF token
        }
        payload = _b64(json.dumps(body, separators=(",", ":"), sort_keys=True).encode())
        return f"{payload}.{self._mac('session', payload)}"

    def read(self, value: str | None, now: datetime) -> Session | None:
        """The session in a cookie value, or None if it is missing, forged or expired."""
        return self.check(value, now)[0]

    def check(self, value: str | None, now: datetime) -> tuple[Session | None, Ended | None]:
        """The session, or why there is none (so the page can say the real cause)."""
        if not value:
            return None, Ended.MISSING
        if value.count(".") != 1:
            return None, Ended.UNREADABLE
        payload, signature = value.split(".")
        if not hmac.compare_digest(signature, self._mac("session", payload)):
            # Not signed by this process: issued before a restart, or altered.
            return None, Ended.NOT_OURS
        try:
            body = json.loads(_unb64(payload))
            expires_at = datetime.fromtimestamp(int(body["e"]), tz=now.tzinfo)
            token_sha256, name = str(body["h"]), str(body["n"])
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None, Ended.UNREADABLE
        if expires_at <= now:
            return None, Ended.EXPIRED
        return Session(token_sha256, name, expires_at, signature), None

    # --- CSRF --------------------------------------------------------------------

    def csrf(self, session: Session) -> str:
        return self._mac("csrf", session.signature)

    def check_csrf(self, session: Session, token: object) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token, self.csrf(session))

    def sign_in_nonce(self) -> str:
        return secrets.token_urlsafe(16)

    def sign_in_csrf(self, nonce: str) -> str:
        return self._mac("sign-in", nonce)

    def check_sign_in_csrf(self, nonce: str | None, token: object) -> bool:
        if not nonce or not isinstance(token, str):
            return False
        return hmac.compare_digest(token, self.sign_in_csrf(nonce))
