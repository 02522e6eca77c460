"""Counting the requests a test's thread sends to Redis: a pipeline is one request,
one round trip (the server's own command count cannot tell them apart)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis


class Sends:
    """Requests this thread sends: ``count`` those to database ``db`` (to any database
    when ``db`` is None), ``by_db`` all of them by database, ``writes`` the socket
    writes those of ``count`` took (a request handed over in pieces is one write per
    piece, and may reach the server in as many packets, run in as many wake-ups), and
    ``scripts`` the script calls (EVALSHA) they carry: on the server each costs more
    than the commands in it."""

    def __init__(self, db: int | None = None) -> None:
        self.db = db
        self.count = self.writes = self.scripts = 0
        self.by_db: dict[int, int] = {}
        self.thread = threading.get_ident()

    def reset(self) -> None:
        self.count = self.writes = self.scripts = 0
        self.by_db = {}

    def __call__(self, conn: Any, command: Any = b"") -> None:
        if threading.get_ident() != self.thread:
            return  # the renewer's, a worker thread's: not the test's calls
        self.by_db[conn.db] = self.by_db.get(conn.db, 0) + 1
        if self.db is None or conn.db == self.db:
            self.count += 1
            self.writes += 1 if isinstance(command, bytes | str) else len(command)
            pieces = [command] if isinstance(command, bytes | str) else command
            for piece in pieces:
                data = piece.encode() if isinstance(piece, str) else bytes(piece)
                self.scripts += data.count(b"\r\nEVALSHA\r\n")


def count_sends(monkeypatch: pytest.MonkeyPatch, counter: Sends) -> Sends:
    """Have ``counter`` hear of every request sent (undone with ``monkeypatch``)."""
    original = redis.connection.AbstractConnection.send_packed_command

    def send_packed_command(conn: Any, command: Any, check_health: bool = True) -> None:
        counter(conn, command)
        original(conn, command, check_health)

    monkeypatch.setattr(
        redis.connection.AbstractConnection, "send_packed_command", send_packed_command
    )
    return counter
