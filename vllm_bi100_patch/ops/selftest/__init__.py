"""``vllm-bi100-patch selftest``: the shim's device checks, timings, projection and
recommendations, run on the operator's card (``docs/selftest.md``).  Needs torch only; never
imports vLLM at import time (``native.find`` imports ``vllm._custom_ops`` where vLLM is
installed, when the selftest runs).

- ``checks`` (with ``magnitudes``, ``reference``, ``slicing``): the device checks against a
  float64 reference (the one home of the checks ``tests/attention/kernels/test_device.py`` runs);
- ``native``: the build's native V1, called only within its limit;
- ``account``: launches and bytes per call (device-independent);
- ``timing``: medians per call at the model's shape, inside memory and time limits;
- ``plan``: pure functions from timings to the projection and the recommendations;
- ``shape``: the per-rank shape from a model's ``config.json``;
- ``cli``, ``report``: the command, its table and JSON.

Nothing is imported here: ``python -m vllm_bi100_patch status`` must not pay for torch.
"""
