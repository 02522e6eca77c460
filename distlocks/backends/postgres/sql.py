"""The PostgreSQL backend's SQL: what each statement means, free of I/O.

Every statement the backend sends is built here, once, at import; the recipes
(:mod:`.session`, :mod:`.transaction`, :mod:`.permits`, :mod:`.listing`) only choose
one and bind its parameters. Keys are the signed 64-bit advisory-lock keys of
:mod:`.keys`; ``TABLE`` is the registry of this app's migration.
"""

from __future__ import annotations

TABLE = "distlocks_lockregistry"
# The token ceiling G (docs/safety.md, "PostgreSQL tokens"): one logged row, at or
# above every token ever issued for any key, written durably when a token passes it.
# The registry is UNLOGGED: a crash truncates it (and ends every advisory lock with it).
FENCE = "distlocks_lockfence"
# The server lifetime marker M: one UNLOGGED row, so it exists iff no crash truncated
# the unlogged tables since it was written; its floor F was G + 1 when it was written,
# above every token issued before that crash. A key without a registry row while M
# exists had its last token before that crash: under F.
EPOCH = "distlocks_lockepoch"

# Tokens are floored by the server clock in microseconds, like the other backends,
# so that they stay comparable and survive a registry that was emptied.
CLOCK_US = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"

#: How far past a token the ceiling G is set when a token passes it, in token units
#: (microseconds while tokens follow the clock): G is written about once per
#: RESERVE_US for the whole server, and a token after a crash is at most about this
#: far ahead of the clock.
RESERVE_US = 600_000_000

# The mint (docs/safety.md, "PostgreSQL tokens") is the function distlocks_mint, which
# migration 0004 creates: its common case is one UPDATE of the key's row, written only
# if the token stays at most the row's ceiling column (a value G had on disk), with no
# read of G or M; otherwise it mints as the statement below did before it, step by
# step in the same transaction: G raised durably when the token passes it (the
# transaction's synchronous_commit "off" turned "on"), M written when missing, and the
# row's ceiling set to the G it read or raised.
MINT = "distlocks_mint"
# Its parameters, typed (the function is found by its argument types); the holder's
# session is pg_backend_pid(), replaced by a parameter in transaction mode.
MINT_CALL = (
    f"{MINT}(%(key)s::bigint, %(name)s::text, %(owner)s::text, %(host)s::text,"
    " %(pid)s::integer, %(thread)s::text, %(ttl)s::double precision, %(extra)s::jsonb,"
    " pg_backend_pid())"
)

# The mint's slow path as a statement (as ACQUIRE was before migration 0004), for the
# what-ifs of bench.profile_pg: G and F as the statement's snapshot sees them, the
# raise of G and the write of M as data-modifying CTEs.
_DURABLE = (
    "set_config('synchronous_commit', CASE current_setting('synchronous_commit')"
    " WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, true)"
)
FENCE_READ = (
    f"SELECT (SELECT ceiling FROM {FENCE} WHERE id = 1) AS ceiling,"
    f" (SELECT floor FROM {EPOCH} WHERE id = 1) AS floor"
)
RAISE = f"""INSERT INTO {FENCE} AS f (id, ceiling)
SELECT 1, minted.fencing_token + {RESERVE_US} FROM {{minted}} AS minted, {{fence}} AS fence
WHERE CASE WHEN minted.fencing_token > coalesce(fence.ceiling, -1)
           THEN {_DURABLE} IS NOT NULL ELSE false END
ON CONFLICT (id) DO UPDATE SET ceiling = greatest(f.ceiling, EXCLUDED.ceiling)"""
MARK = f"""INSERT INTO {EPOCH} (id, floor)
SELECT 1, coalesce(fence.ceiling, 0) + 1 FROM {{minted}} AS minted, {{fence}} AS fence
WHERE fence.floor IS NULL
ON CONFLICT (id) DO NOTHING"""

# An upper bound of every token of a key that has no registry row: F - 1 while M
# exists, else G (0 with neither: nothing was ever issued).
ROWLESS_BOUND = (
    f"coalesce((SELECT floor - 1 FROM {EPOCH} WHERE id = 1),"
    f" (SELECT ceiling FROM {FENCE} WHERE id = 1), 0)"
)

# The acquisition shared by both modes; {lock} is a query taking the lock and yielding
# one boolean "ok". The token is minted only if the lock was granted, in the same
# statement (one transaction: a raise of G commits with the token, durably). No row:
# not granted.
ACQUIRE = f"""
WITH granted AS MATERIALIZED ({{lock}})
SELECT {MINT_CALL} FROM granted WHERE granted.ok
"""

# Live advisory locks of this database (classid/objid are the high/low 32 bits of
# the bigint key ``lkey``), joined with the registry and the holder's session:
# exclusive holders (locks, write leases, semaphore slots) with the row of their
# key; shared holders (read leases) with their own row, found by name through the
# read-write lock's row and by session. Callers append "AND ..." conditions.
LIVE = """(
    SELECT pid, database, classid, objid, mode,
           ((classid::bigint << 32) | objid::bigint) AS lkey
    FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND granted
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
)"""
COLUMNS = """r.name, r.owner, r.fencing_token, r.host, r.pid, r.thread, r.acquired_at, r.ttl,
       r.renewals, r.extra, l.pid AS backend_pid, r.backend_pid AS row_pid, a.application_name,
       host(a.client_addr) AS client_addr, a.state, a.state_change, l.lkey, l.mode,
       (SELECT count(*) FROM waiting w
         WHERE w.classid = l.classid AND w.objid = l.objid) AS waiters"""
# The waiting requests are read from pg_locks once per query: a subquery on pg_locks
# itself would copy the server's whole lock table once per live lock (quadratic).
LOCKS = f"""
WITH waiting AS MATERIALIZED (
    SELECT classid, objid FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND NOT granted
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
)
SELECT * FROM (
    SELECT {COLUMNS}
    FROM {LIVE} l
    JOIN {TABLE} r ON r.key = l.lkey
    LEFT JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.mode = 'ExclusiveLock'
  UNION ALL
    SELECT {COLUMNS}
    FROM {LIVE} l
    JOIN {TABLE} rw ON rw.key = l.lkey
    JOIN {TABLE} r ON r.name = rw.name AND r.backend_pid = l.pid
      AND r.extra->>'kind' = 'read' AND r.extra->>'of' = l.lkey::text
    LEFT JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.mode = 'ShareLock'
) AS live WHERE true
"""

TRY = "SELECT pg_try_advisory_lock(%(key)s) AS ok"
WAIT = "SELECT true AS ok FROM (SELECT pg_advisory_lock(%(key)s)) AS waited"
TRY_SHARED = "SELECT pg_try_advisory_lock_shared(%(key)s) AS ok"
WAIT_SHARED = "SELECT true AS ok FROM (SELECT pg_advisory_lock_shared(%(key)s)) AS waited"
# Every statement that gives a lock back first takes the name's guard key, shared and
# until the statement ends: a force release holds it exclusively while it checks who
# holds the lock and ends that session, so the holder it checked cannot give the lock
# back and move on to another lease on the same connection in between.
UNLOCK = (
    "SELECT pg_advisory_unlock(%(key)s)"
    " FROM (SELECT pg_advisory_xact_lock_shared(%(guard)s)) AS guarded"
)

# -- semaphores and read-write locks (session mode). Their registry rows say what
# they belong to in extra: "kind" and "of" (the id of the semaphore or read-write
# lock, a key derived from its name, as text).

# A holder's registry row, for {source} rows with the columns key and extra.
PERMIT_ROW = f"""
INSERT INTO {TABLE} AS r
    (key, name, fencing_token, owner, host, pid, thread, backend_pid,
     acquired_at, ttl, renewals, extra)
SELECT source.key, %(name)s, 0, %(owner)s, %(host)s, %(pid)s, %(thread)s,
       pg_backend_pid(), clock_timestamp(), %(ttl)s, 0, source.extra
FROM {{source}} AS source
ON CONFLICT (key) DO UPDATE SET
    name = EXCLUDED.name, owner = EXCLUDED.owner,
    host = EXCLUDED.host, pid = EXCLUDED.pid, thread = EXCLUDED.thread,
    backend_pid = EXCLUDED.backend_pid, acquired_at = EXCLUDED.acquired_at,
    ttl = EXCLUDED.ttl, renewals = 0, extra = EXCLUDED.extra
"""

# A semaphore of N permits is N advisory-lock slots: try them in order, stopping at
# the first one granted (a recursive query goes on only while none was), and record
# the holder on the slot's row. Returns the slot's key when one was free.
SEM_ACQUIRE = (
    """
WITH RECURSIVE slots(i, ok) AS (
    SELECT 1, pg_try_advisory_lock((%(keys)s::bigint[])[1])
  UNION ALL
    SELECT i + 1, pg_try_advisory_lock((%(keys)s::bigint[])[i + 1])
    FROM slots WHERE NOT ok AND i < %(limit)s
), granted AS MATERIALIZED (
    SELECT (%(keys)s::bigint[])[i] AS key,
           %(extra)s::jsonb || jsonb_build_object('slot', i - 1) AS extra
    FROM slots WHERE ok
)
"""
    + PERMIT_ROW.format(source="granted")
    + "RETURNING r.key"
)

# The write side: the lock's own statement on the read-write lock's key (its row
# keeps the write fencing counter), which also drops the rows of readers: none can
# hold the lock while the writer does, so any left are those of crashed readers.
WRITE_ACQUIRE = ACQUIRE.replace(
    "WITH granted AS MATERIALIZED ({lock})",
    f"""WITH granted AS MATERIALIZED ({{lock}}), cleared AS (
    DELETE FROM {TABLE}
    WHERE name = %(name)s AND extra->>'kind' = 'read' AND extra->>'of' = %(of)s
      AND EXISTS (SELECT 1 FROM granted WHERE granted.ok)
)""",
)
assert "cleared" in WRITE_ACQUIRE

# The read side: a shared lock on the same key, and a row of the reader's own (the
# lock's row, created if missing, is where the listing finds it by name; created with
# ROWLESS_BOUND as its token, which is at least every write token issued for a key
# without a row, so the next writer's token, one more, stays above them). A row of
# an earlier reader on this same session is stale: a session holds one lease.
READ_ACQUIRE = (
    f"""
WITH granted AS MATERIALIZED ({{lock}}), anchor AS (
    INSERT INTO {TABLE} (key, name, fencing_token, owner, host, thread, renewals, extra)
    SELECT %(key)s, %(name)s, {ROWLESS_BOUND}, '', '', '', 0,
           jsonb_build_object('kind', 'write', 'of', %(of)s::text)
    FROM granted WHERE granted.ok
    ON CONFLICT (key) DO NOTHING
), stale AS (
    DELETE FROM {TABLE}
    WHERE name = %(name)s AND extra->>'kind' = 'read' AND extra->>'of' = %(of)s
      AND backend_pid = pg_backend_pid() AND key <> %(reader)s
      AND EXISTS (SELECT 1 FROM granted WHERE granted.ok)
), reader AS (
    SELECT %(reader)s::bigint AS key, %(extra)s::jsonb AS extra
    FROM granted WHERE granted.ok
), mine AS ("""
    + PERMIT_ROW.format(source="reader")
    + """RETURNING 1
)
SELECT 0 FROM granted WHERE granted.ok
"""
)
READ_UNLOCK = f"""
WITH guarded AS MATERIALIZED (SELECT pg_advisory_xact_lock_shared(%(guard)s)),
gone AS (DELETE FROM {TABLE} WHERE key = %(reader)s)
SELECT pg_advisory_unlock_shared(%(key)s) FROM guarded
"""

# The sessions holding permits of one semaphore or read-write lock (one owner's, or
# all), each listed with its own registry row (a row still naming an earlier session is
# an acquire in flight, not a holder).
PERMIT_TARGETS = f"""
SELECT DISTINCT backend_pid FROM ({LOCKS}
    AND extra->>'of' = %(of)s AND (%(owner)s::text IS NULL OR owner = %(owner)s)
    AND row_pid = backend_pid
) AS held
"""
# Ends sessions and waits (up to 5 s) until each has ended, so what they held is free
# on return. Returns how many were ended (PostgreSQL 14+, as Django).
TERMINATE = (
    "SELECT count(*) FILTER (WHERE ok) FROM"
    " (SELECT pg_terminate_backend(pid, 5000) AS ok FROM unnest(%(pids)s::integer[]) AS pid)"
    " AS ended"
)
BUMP = f"""
UPDATE {TABLE} SET fencing_token = greatest(fencing_token + 1, {{clock}})
WHERE key = %(key)s
""".format(clock=CLOCK_US)
HOLDER = """
SELECT l.pid FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ExclusiveLock'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = %(classid)s AND l.objid = %(objid)s
"""
TRY_XACT = "SELECT pg_try_advisory_xact_lock(%(key)s) AS ok"
# Transaction mode's registry write, on a pooled connection once the caller's
# transaction holds the lock: the holder's session is the caller's, not this one.
REGISTER_XACT = ACQUIRE.format(lock="SELECT true AS ok").replace(
    "pg_backend_pid()", "%(backend_pid)s::integer"
)
assert "%(backend_pid)s" in REGISTER_XACT
# The uncontended acquire, built once (it runs on every try).
ACQUIRE_TRY = ACQUIRE.format(lock=TRY)
WAIT_XACT = "SELECT true AS ok FROM (SELECT pg_advisory_xact_lock(%(key)s)) AS waited"

# Transaction mode: the holder's lock lives in its transaction, which gives it back at
# COMMIT; no statement of ours runs there to wait for a guard. The check (the
# registry's token is the one shown) and the signal are one statement; the counter
# moves only if a session was ended. The holder's own registry write commits with its
# transaction, so the row read here, like the listing, is the last committed one.
FORCE_RELEASE_XACT = f"""
WITH registered AS MATERIALIZED (
    SELECT fencing_token, backend_pid FROM {TABLE} WHERE key = %(key)s
), holder AS MATERIALIZED ({HOLDER}
      AND (%(token)s::bigint IS NULL OR EXISTS (
          SELECT 1 FROM registered WHERE registered.fencing_token = %(token)s))
), killed AS MATERIALIZED (
    SELECT pg_terminate_backend(pid, 5000) AS ok FROM holder
), bumped AS (
    UPDATE {TABLE} SET fencing_token = greatest(fencing_token + 1, {CLOCK_US})
    WHERE key = %(key)s AND EXISTS (SELECT 1 FROM killed WHERE ok) RETURNING 1
)
SELECT coalesce(bool_or(ok), false) FROM killed
"""

# The session-mode acquire that waits in the server's queue (bounded by lock_timeout).
ACQUIRE_WAIT = ACQUIRE.format(lock=WAIT)

# Whether this session holds the advisory lock (classid, objid): a lease's renewal ping.
HOLDS = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid()"
    " AND locktype = 'advisory' AND classid = %s AND objid = %s"
    " AND objsubid = 1 AND granted)"
)

# The registry row of a key, locked until the force release's transaction ends.
REGISTERED_FOR_UPDATE = (
    f"SELECT fencing_token, backend_pid FROM {TABLE} WHERE key = %(key)s FOR UPDATE"
)

# The last fencing token of a key, from its registry row; 0 with no row: never
# locked, or (as on Redis after a restart without persistence) its row was lost in a
# server crash: its next token is still above every earlier one.
COUNTER = f"SELECT fencing_token FROM {TABLE} WHERE key = %s"

# The listing's own query: the columns of LOCKS that a LockInfo needs, the holder
# details as JSON text (parsed only when there are some), rows as plain tuples.
LISTING = f"""
    SELECT name, owner, fencing_token, host, pid, thread, acquired_at, ttl, renewals,
           extra::text, backend_pid, application_name, client_addr, state, state_change,
           waiters
    FROM ({LOCKS}) AS listed
    """
