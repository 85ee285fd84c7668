"""Serving: what stands between a request and the engine.

Owns the scheduler and engine entries (``seq_limit``, ``seq_limit_front``, ``async_engine``,
``llm_batch``), the OpenAI front end (request bodies: ``request_body``, ``chat_compat``,
``completion_compat``, ``error_cause``; tools: ``tool_choice``, ``tool_args``, ``tool_calls``,
``tool_stream``; hermes streaming: ``hermes_args``, ``hermes_reading``) and guided decoding
(``guided``, ``guided_imports``).

May import: ``activation`` and ``patching``.  Never ``attention``, ``engine`` or ``ops``, and
never vLLM at import (the target module is handed in).  A new serving row: its factory here,
its ``Patch`` in ``patching/rows_serving.py``.
"""
