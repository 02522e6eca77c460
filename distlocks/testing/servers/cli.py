"""``python -m distlocks.testing.servers [--no-redis] [--no-postgres] -- command``:
start the servers, run the command with their URLs in its environment, then stop them."""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess

from distlocks.testing.servers.process import DATABASE_URL_ENV, REDIS_URL_ENV, restore_ctrl_c
from distlocks.testing.servers.session import ensure_test_servers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlocks.testing.servers",
        description="Start throwaway Redis and PostgreSQL servers, run a command with "
        f"{REDIS_URL_ENV} and {DATABASE_URL_ENV} set, then stop and remove the servers.",
    )
    parser.add_argument("--no-redis", action="store_true", help="do not start Redis")
    parser.add_argument("--no-postgres", action="store_true", help="do not start PostgreSQL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="command to run (after --)")
    args = parser.parse_args(argv)
    restore_ctrl_c()  # Ctrl-C stops the servers, whatever SIGINT this process inherited
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    redis_url, database_url = ensure_test_servers(
        redis=not args.no_redis, postgres=not args.no_postgres
    )
    print(f"{REDIS_URL_ENV}={redis_url}", flush=True)
    print(f"{DATABASE_URL_ENV}={database_url}", flush=True)
    if not command:
        # The announcement is inside the try: whoever reads it may press Ctrl-C at once.
        with contextlib.suppress(KeyboardInterrupt):
            print("Servers are up; press Ctrl-C to stop them.", flush=True)
            signal.pause()
        return 0
    child: subprocess.Popen[bytes] | None = None
    while True:
        try:
            if child is None:
                child = subprocess.Popen(command)
            return child.wait()
        except KeyboardInterrupt:
            if child is None:  # Ctrl-C before the command started: nothing to wait for
                return 130
            # The child got the same SIGINT from the terminal; let it finish.
            continue
