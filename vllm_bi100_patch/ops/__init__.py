"""Ops: the operator's tools, on top of everything else.

Owns ``status()`` (``status``, the face's ``vllm_bi100_patch.status``), doctor (``doctor``,
its guided-decoding section ``doctor_serving``, the audit of vLLM's ops module ``audit``, the
performance hints ``advice``), whether every prompt attention is the shim's (``invariance``)
and ``selftest/`` (the device checks, timings and recommendations).

May import: every room.  Imported by nothing but the package's face and the CLI
(``__main__``).  A new operator check goes here; it reads the rooms, never patches.
"""
