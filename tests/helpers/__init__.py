"""Helpers shared by the test modules, found as ``helpers`` through pytest's ``pythonpath``
(``pyproject.toml``); scripts run outside pytest put ``tests/`` on ``sys.path`` themselves.

- ``reference``, ``slicing``: the dense float64 reference, the paged-cache builders and the
  slicings of one prompt (their home: ``vllm_bi100_patch.ops.selftest``, re-exported here);
- ``probes``: both ends of a probe run in a fresh interpreter (stdlib only at import, so the
  probes in other venvs can use it): the report line, the shim's and prefix_prefill's state;
- ``shim``: subprocess runners for activation tests, the family table, test venv paths.
"""
