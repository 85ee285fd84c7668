"""Activation: how the shim comes on in a process, and the settings it comes on with.

Owns the one bootstrap every path calls (``bootstrap``: ``sitecustomize``, the ``.pth`` line,
vLLM's ``vllm.general_plugins`` entry point, ``apply()``), the process's activation state
(``phase``), the post-import finder (``hooks``), every environment variable (``config``) and
the package logger (``log``).

May import: the standard library and ``patching`` (the table it arms hooks for, the decision,
the registry it runs once vLLM imports a target module).  Never torch, vLLM or wrapt, and
nothing at interpreter start that could raise into the host process.
"""
