"""Counting, in one home: every counter of the process by name (``counters``), the counts kept
for /metrics only (``metrics.TALLY``: decode reasons and lengths, prefix paths, refusals) and
their Prometheus export (``export``: multiprocess files or an in-process collector).

Stdlib only; may import ``activation`` (the logger) and the table.  The rows and the native
decoder add to counters registered here; ``status()``, doctor and /metrics read them.
"""
