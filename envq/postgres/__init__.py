"""envq on PostgreSQL: the first step, the database side of envq's tables.

What exists now is :mod:`envq.postgres.schema`: the SQL that creates envq's tables
in a PostgreSQL database, with the envelope and queue states as enums and triggers,
generated from ``envq._machine``, that refuse any change of state the tables do not
allow, and SQL functions that start and end attempts under leases with fencing
tokens. The queue itself (workers, ``send``, reaping expired leases) is not built
yet; see ``docs/postgres.md``.
"""
