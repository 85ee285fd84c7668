"""Patching: the machinery every patch row goes through, whatever it patches.

Owns the row type (``patch_row``) and the table (``table``, its serving rows in
``rows_serving``), the method rows' specs and descriptor checks (``specs``), the
registry (``registry``: saved originals, all-or-nothing apply, exact revert; its ``report``),
what a row's factory is built with (``factories``: the factory type, the argument reader, the
call counters), class rebinding (``rebind``), the code checks (``source``: one parse;
``code_shapes``: the method a row targets and its fingerprint; ``missing_calls``), vLLM
versions and signature families (``versions``), the one decision and hardware facts
(``decision``, ``hardware``), strict mode (``strict``) and counting (``counting/``: every
counter, the metrics' tally, their Prometheus export).

May import: the standard library, wrapt (the registry) and ``activation`` (configuration, the
logger).  Never a domain room (``attention``, ``engine``, ``serving``) nor ``ops``: a row names
its factory as a string (``"module:function"``), resolved when its target module is patched.
A new row of any kind is a ``Patch`` in ``table`` (serving rows: ``rows_serving``), its
factory in the room of its domain.
"""
