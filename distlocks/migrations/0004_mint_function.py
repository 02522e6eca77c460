"""The PostgreSQL backend's token mint as a function (docs/safety.md, "PostgreSQL tokens").

On PostgreSQL only (other vendors' tables are left as they were):

- adds the column ``ceiling`` to the registry (not to the model: only this backend's
  SQL reads or writes it; rows written without it get 0): the value of the ceiling G
  that the row's last slow mint saw on disk, or raised;
- creates the function ``distlocks_mint``, which every acquisition calls once its
  advisory lock is granted. Its common case is one UPDATE of the key's row, written
  only if the new token is at most the row's ``ceiling``: no read of G or of the
  marker M, and no write but the row's. Otherwise (a new key, a token past the row's
  ceiling, a missing marker) it runs the mint of migration 0003's statement, step by
  step, in the same transaction: G raised durably when the token passes it, M written
  when missing, and the row's ``ceiling`` set to the G it read or raised.

The body is a literal of this migration: a migration must not change with later code
(a new body is a new migration). Reversible: the function and the column are dropped.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

REGISTRY = "distlocks_lockregistry"
FENCE = "distlocks_lockfence"
EPOCH = "distlocks_lockepoch"
FUNCTION = "distlocks_mint"
SIGNATURE = "bigint, text, text, text, integer, text, double precision, jsonb, integer"
# The same reserve as the backend's (distlocks.backends.postgres.sql.RESERVE_US).
RESERVE_US = 600_000_000

# Each statement of a VOLATILE plpgsql function reads with a snapshot of its own (READ
# COMMITTED), taken after the caller's statement was granted the advisory lock: every
# mint of the key before this one has committed and is seen.
BODY = f"""
DECLARE
    now_us bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    minted bigint;
    fence_ceiling bigint;
    epoch_floor bigint;
    raised bigint;
BEGIN
    -- The common case: the key's row moves on by one (or to the clock), only if the
    -- token stays at most the row's ceiling, a value G had on disk (or higher).
    UPDATE {REGISTRY} AS r
    SET fencing_token = greatest(r.fencing_token + 1, now_us),
        name = p_name, owner = p_owner, host = p_host, pid = p_pid, thread = p_thread,
        backend_pid = p_backend_pid, acquired_at = clock_timestamp(), ttl = p_ttl,
        renewals = 0, extra = p_extra
    WHERE r.key = p_key AND greatest(r.fencing_token + 1, now_us) <= r.ceiling
    RETURNING r.fencing_token INTO minted;
    IF FOUND THEN
        RETURN minted;
    END IF;

    -- The slow mint: G and F as they are now (NULL when missing).
    SELECT (SELECT ceiling FROM {FENCE} WHERE id = 1), (SELECT floor FROM {EPOCH} WHERE id = 1)
      INTO fence_ceiling, epoch_floor;
    -- With a row: one more than it (or the clock). Without: F while M exists, else
    -- G + 1. The row's ceiling becomes the G just read.
    INSERT INTO {REGISTRY} AS r
        (key, name, fencing_token, owner, host, pid, thread, backend_pid,
         acquired_at, ttl, renewals, extra, ceiling)
    VALUES (p_key, p_name,
            greatest(coalesce(epoch_floor, coalesce(fence_ceiling, 0) + 1), now_us),
            p_owner, p_host, p_pid, p_thread, p_backend_pid, clock_timestamp(), p_ttl, 0,
            p_extra, coalesce(fence_ceiling, 0))
    ON CONFLICT (key) DO UPDATE SET
        fencing_token = greatest(r.fencing_token + 1, now_us),
        name = EXCLUDED.name, owner = EXCLUDED.owner,
        host = EXCLUDED.host, pid = EXCLUDED.pid, thread = EXCLUDED.thread,
        backend_pid = EXCLUDED.backend_pid, acquired_at = EXCLUDED.acquired_at,
        ttl = EXCLUDED.ttl, renewals = 0, extra = EXCLUDED.extra,
        ceiling = EXCLUDED.ceiling
    RETURNING r.fencing_token INTO minted;

    IF minted > coalesce(fence_ceiling, -1) THEN
        -- The token passes G: G goes past it, and this transaction commits durably
        -- ("off" becomes "on" for it alone; other settings are kept), so the token
        -- is seen by no one before a G covering it is on disk.
        PERFORM set_config('synchronous_commit',
            CASE current_setting('synchronous_commit')
                WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END,
            true);
        INSERT INTO {FENCE} AS f (id, ceiling) VALUES (1, minted + {RESERVE_US})
        ON CONFLICT (id) DO UPDATE SET ceiling = greatest(f.ceiling, EXCLUDED.ceiling)
        RETURNING f.ceiling INTO raised;
        UPDATE {REGISTRY} SET ceiling = raised WHERE key = p_key;
    END IF;
    IF epoch_floor IS NULL THEN
        -- M written with the G read above, after the last crash; sessions may race
        -- here, and the first M stands.
        INSERT INTO {EPOCH} (id, floor) VALUES (1, coalesce(fence_ceiling, 0) + 1)
        ON CONFLICT (id) DO NOTHING;
    END IF;
    RETURN minted;
END
"""

CREATE = f"""
CREATE OR REPLACE FUNCTION {FUNCTION}(
    p_key bigint, p_name text, p_owner text, p_host text, p_pid integer, p_thread text,
    p_ttl double precision, p_extra jsonb, p_backend_pid integer
) RETURNS bigint LANGUAGE plpgsql VOLATILE AS $mint$ {BODY} $mint$
"""


def forwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    registry = schema_editor.quote_name(REGISTRY)
    schema_editor.execute(
        f"ALTER TABLE {registry} ADD COLUMN IF NOT EXISTS ceiling bigint NOT NULL DEFAULT 0"
    )
    schema_editor.execute(CREATE)


def backwards(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}({SIGNATURE})")
    schema_editor.execute(
        f"ALTER TABLE {schema_editor.quote_name(REGISTRY)} DROP COLUMN IF EXISTS ceiling"
    )


class Migration(migrations.Migration):
    dependencies = [
        ("distlocks", "0003_lockfence"),
    ]

    operations = [
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
