"""Patching layer: the replacements for vLLM symbols, one module per target module.

The catalogue (each patch's why, how, vLLM versions, upstream status and removal plan) is
``vllm_bi100_patch.table``; each row names the factory here that builds its wrapper (a
``_common.Factory``) and the call counters it adds to.  ``_common`` holds what every module
shares: the wrapper and factory types, the argument reader and the counters.
"""
