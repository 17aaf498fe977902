"""The provider's own store: tickets, idempotency keys, and the effect ledger.

Every ticket row is an *effect*: something the outside world would see. Tests
and the demo count duplicates here, from the provider's side, instead of
trusting what the client believes happened.

Durability: with a file, the store runs in WAL mode with ``synchronous=FULL``,
and a ticket (with its idempotency key's stored reply) commits in one
transaction *before* any reply is sent. So a ``kill -9`` at any point never
loses a ticket whose creation was answered, and a key is never left pointing
at a missing ticket. Without a file the store is an in-memory SQLite database
with the same schema and the same code path.

One connection, guarded by a lock: the app serves from one event loop, but
tests read the ledger from their own thread while a uvicorn thread serves.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    subject TEXT NOT NULL,
    body TEXT NOT NULL,
    priority TEXT NOT NULL,
    client_reference TEXT,
    idempotency_key TEXT,
    request_digest TEXT NOT NULL,
    outcome TEXT NOT NULL,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ix_tickets_client_reference ON tickets (client_reference);
CREATE INDEX IF NOT EXISTS ix_tickets_idempotency_key ON tickets (idempotency_key);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key TEXT PRIMARY KEY,
    request_digest TEXT NOT NULL,
    state TEXT NOT NULL CONSTRAINT ck_idempotency_keys_state
        CHECK (state IN ('in_progress', 'completed')),
    ticket_seq INTEGER REFERENCES tickets (seq),
    status_code INTEGER,
    response_body BLOB,
    created_at TEXT NOT NULL,
    completed_at TEXT,
    CONSTRAINT ck_idempotency_keys_completed_has_reply
        CHECK (state = 'in_progress' OR (status_code IS NOT NULL AND response_body IS NOT NULL))
);
"""

TICKET_ID_PREFIX = "tkt_"


def ticket_id(seq: int) -> str:
    """The public id of the ticket stored at ``seq`` (``tkt_000042``)."""
    return f"{TICKET_ID_PREFIX}{seq:06d}"


def _seq_of(ticket_id_: str) -> int | None:
    if not ticket_id_.startswith(TICKET_ID_PREFIX):
        return None
    digits = ticket_id_[len(TICKET_ID_PREFIX) :]
    return int(digits) if digits.isdigit() else None


def isoformat(at: datetime) -> str:
    """Fixed-width UTC ISO 8601, so stored timestamps also sort correctly as text."""
    if at.tzinfo is None:
        raise ValueError("timestamps must be timezone-aware")
    return at.astimezone(UTC).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class NewTicket:
    """The validated fields of a ticket-creating request."""

    subject: str
    body: str
    priority: str
    client_reference: str | None


@dataclass(frozen=True)
class Ticket:
    """One stored ticket: what ``GET /v1/tickets/{id}`` shows, plus the ledger columns."""

    seq: int
    subject: str
    body: str
    priority: str
    client_reference: str | None
    idempotency_key: str | None
    outcome: str  # the fault outcome applied to the request that created it
    created_at: str

    @property
    def id(self) -> str:
        return ticket_id(self.seq)

    def to_json(self) -> dict[str, Any]:
        """The public representation (the 201 body and lookup items)."""
        return {
            "id": self.id,
            "subject": self.subject,
            "body": self.body,
            "priority": self.priority,
            "status": "open",
            "client_reference": self.client_reference,
            "created_at": self.created_at,
        }

    def to_effect(self) -> dict[str, Any]:
        """The ledger representation (``GET /_admin/effects``)."""
        return {
            "id": self.id,
            "idempotency_key": self.idempotency_key,
            "client_reference": self.client_reference,
            "created_at": self.created_at,
            "outcome": self.outcome,
        }


class ClaimStatus(StrEnum):
    """What claiming an idempotency key found."""

    CLAIMED = "claimed"  # the key is ours: process the request, then complete the key
    IN_PROGRESS = "in_progress"  # another request holds it right now: 409
    REPLAY = "replay"  # completed with the same body: send the stored reply
    MISMATCH = "mismatch"  # used before with a different body: 422


@dataclass(frozen=True)
class KeyClaim:
    """The answer of :meth:`Ledger.claim_key`; a stored reply only for ``REPLAY``."""

    status: ClaimStatus
    status_code: int | None = None
    response_body: bytes | None = None


class Ledger:
    """Tickets and idempotency keys in SQLite (a file, or memory when ``path`` is None)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._lock = threading.RLock()
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, so a
        # transaction takes the write lock up front instead of upgrading late.
        self._conn = sqlite3.connect(
            path or ":memory:", check_same_thread=False, isolation_level=None, timeout=5.0
        )
        self._conn.row_factory = sqlite3.Row
        with self._lock:
            if path:
                self._conn.execute("PRAGMA journal_mode=WAL")
                # FULL: a commit is on disk before we reply, the durability promise.
                self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.executescript(_SCHEMA)
            # A key left in progress belongs to a request of a process that is
            # gone (kill -9 mid-request): its ticket never committed, so free
            # the key, or every retry would get 409 forever.
            with self._transaction():
                self._conn.execute("DELETE FROM idempotency_keys WHERE state = 'in_progress'")

    def close(self) -> None:
        """Close the connection; the ledger cannot be used afterwards."""
        with self._lock:
            self._conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # -- idempotency keys -------------------------------------------------

    def claim_key(
        self, key: str, request_digest: str, *, now: datetime, retention: timedelta
    ) -> KeyClaim:
        """Take ``key`` for a request with ``request_digest``, or say who has it.

        Atomic: of any number of concurrent claims of one key, exactly one gets
        ``CLAIMED``. A record older than ``retention`` is forgotten first, so
        the key is new again (the documented window).
        """
        cutoff = isoformat(now - retention)
        with self._transaction() as conn:
            conn.execute(
                "DELETE FROM idempotency_keys WHERE key = ? AND created_at < ?", (key, cutoff)
            )
            inserted = conn.execute(
                "INSERT INTO idempotency_keys (key, request_digest, state, created_at) "
                "VALUES (?, ?, 'in_progress', ?) ON CONFLICT (key) DO NOTHING",
                (key, request_digest, isoformat(now)),
            ).rowcount
            if inserted:
                return KeyClaim(ClaimStatus.CLAIMED)
            row = conn.execute(
                "SELECT request_digest, state, status_code, response_body "
                "FROM idempotency_keys WHERE key = ?",
                (key,),
            ).fetchone()
        if row["request_digest"] != request_digest:
            return KeyClaim(ClaimStatus.MISMATCH)
        if row["state"] == "in_progress":
            return KeyClaim(ClaimStatus.IN_PROGRESS)
        return KeyClaim(ClaimStatus.REPLAY, row["status_code"], bytes(row["response_body"]))

    def release_key(self, key: str) -> None:
        """Give up a claim whose request stored nothing, so a retry can run it."""
        with self._transaction() as conn:
            conn.execute(
                "DELETE FROM idempotency_keys WHERE key = ? AND state = 'in_progress'", (key,)
            )

    # -- tickets ----------------------------------------------------------

    def create_ticket(
        self,
        fields: NewTicket,
        *,
        idempotency_key: str | None,
        request_digest: str,
        outcome: str,
        now: datetime,
        complete_key: bool,
    ) -> tuple[Ticket, bytes]:
        """Store a ticket and return it with its 201 body, committed before returning.

        With ``complete_key`` the claimed key is completed with that exact body
        in the same transaction, so a replay returns the bytes of the first
        reply, and a crash leaves either both or neither.
        """
        created_at = isoformat(now)
        with self._transaction() as conn:
            cursor = conn.execute(
                "INSERT INTO tickets (subject, body, priority, client_reference, "
                "idempotency_key, request_digest, outcome, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    fields.subject,
                    fields.body,
                    fields.priority,
                    fields.client_reference,
                    idempotency_key,
                    request_digest,
                    outcome,
                    created_at,
                ),
            )
            seq = cursor.lastrowid
            assert seq is not None
            ticket = Ticket(
                seq=seq,
                subject=fields.subject,
                body=fields.body,
                priority=fields.priority,
                client_reference=fields.client_reference,
                idempotency_key=idempotency_key,
                outcome=outcome,
                created_at=created_at,
            )
            reply = json.dumps(ticket.to_json(), separators=(",", ":")).encode()
            if complete_key and idempotency_key is not None:
                # An upsert, not an UPDATE: if an admin reset removed the claim
                # mid-request, the ticket still exists and its key must say so.
                conn.execute(
                    "INSERT INTO idempotency_keys (key, request_digest, state, ticket_seq, "
                    "status_code, response_body, created_at, completed_at) "
                    "VALUES (?, ?, 'completed', ?, 201, ?, ?, ?) "
                    "ON CONFLICT (key) DO UPDATE SET state = 'completed', "
                    "ticket_seq = excluded.ticket_seq, status_code = 201, "
                    "response_body = excluded.response_body, "
                    "completed_at = excluded.completed_at",
                    (idempotency_key, request_digest, seq, reply, created_at, created_at),
                )
        return ticket, reply

    def get_ticket(self, ticket_id_: str) -> Ticket | None:
        """The ticket with public id ``ticket_id_``, if any."""
        seq = _seq_of(ticket_id_)
        if seq is None:
            return None
        with self._lock:
            row = self._conn.execute("SELECT * FROM tickets WHERE seq = ?", (seq,)).fetchone()
        return None if row is None else _ticket(row)

    def find_tickets(
        self,
        *,
        client_reference: str | None = None,
        idempotency_key: str | None = None,
        created_at_or_before: datetime | None = None,
    ) -> list[Ticket]:
        """Tickets matching every given filter, oldest first (duplicates included)."""
        clauses: list[str] = []
        params: list[str] = []
        if client_reference is not None:
            clauses.append("client_reference = ?")
            params.append(client_reference)
        if idempotency_key is not None:
            clauses.append("idempotency_key = ?")
            params.append(idempotency_key)
        if created_at_or_before is not None:
            clauses.append("created_at <= ?")
            params.append(isoformat(created_at_or_before))
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT * FROM tickets {where} ORDER BY seq", params
            ).fetchall()
        return [_ticket(row) for row in rows]

    def tickets(self) -> list[Ticket]:
        """Every ticket, oldest first: the effect ledger."""
        return self.find_tickets()

    def key_state(self, key: str) -> str | None:
        """``in_progress``, ``completed`` or None: lets tests wait for a claim."""
        with self._lock:
            row = self._conn.execute(
                "SELECT state FROM idempotency_keys WHERE key = ?", (key,)
            ).fetchone()
        return None if row is None else str(row["state"])

    def stats(self) -> dict[str, Any]:
        """Counts that show duplicates from the provider's side."""
        with self._lock:
            conn = self._conn
            total = conn.execute("SELECT COUNT(*) FROM tickets").fetchone()[0]
            references = conn.execute(
                "SELECT COUNT(DISTINCT client_reference) FROM tickets"
            ).fetchone()[0]
            keys = conn.execute("SELECT COUNT(DISTINCT idempotency_key) FROM tickets").fetchone()[0]
            duplicates = conn.execute(
                "SELECT client_reference, COUNT(*) FROM tickets "
                "WHERE client_reference IS NOT NULL "
                "GROUP BY client_reference HAVING COUNT(*) > 1 ORDER BY client_reference"
            ).fetchall()
            duplicate_keys = conn.execute(
                "SELECT idempotency_key, COUNT(*) FROM tickets "
                "WHERE idempotency_key IS NOT NULL "
                "GROUP BY idempotency_key HAVING COUNT(*) > 1 ORDER BY idempotency_key"
            ).fetchall()
        return {
            "tickets": total,
            "distinct_references": references,
            "distinct_keys": keys,
            "duplicates": {row[0]: row[1] for row in duplicates},
            "duplicate_keys": {row[0]: row[1] for row in duplicate_keys},
        }

    def reset(self) -> None:
        """Forget every ticket and key. Ids are not reused, so a stale id finds nothing."""
        with self._transaction() as conn:
            conn.execute("DELETE FROM idempotency_keys")
            conn.execute("DELETE FROM tickets")


def _ticket(row: sqlite3.Row) -> Ticket:
    return Ticket(
        seq=row["seq"],
        subject=row["subject"],
        body=row["body"],
        priority=row["priority"],
        client_reference=row["client_reference"],
        idempotency_key=row["idempotency_key"],
        outcome=row["outcome"],
        created_at=row["created_at"],
    )
