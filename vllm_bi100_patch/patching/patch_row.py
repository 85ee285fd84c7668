"""One row of the patch table (``patch_row.Patch``), the row kinds and the vLLM modules the rows
target: a module of its own so that the table and its row groups (``rows_serving``) share it.

Imported at interpreter start by the bootstrap: stdlib only, no typing, no torch, no vLLM.
"""

from __future__ import annotations

TYPE_CHECKING = False  # read at interpreter start: keep it bare
if TYPE_CHECKING:
    from typing import Optional, Tuple

WRAP_METHOD = "wrap_method"
WRAP_INSTANCE = "wrap_instance_method"
GUARD_IMPORT = "guard_import"
REPLACE_CLASS = "replace_class"
#: A module-level function wrapped in its module (``module:function``) and wherever vLLM bound it.
REPLACE_FUNCTION = "replace_function"


class Patch:
    """One row of the table (read-only by convention)."""

    __slots__ = ("name", "kind", "target", "params", "factory", "when", "counters", "why", "how",
                 "vllm", "upstream", "removal")

    def __init__(self, name: str, kind: str, target: str, factory: str, *, why: str, how: str,
                 vllm: str, upstream: str, removal: str, params: Optional[str] = None,
                 when: Optional[str] = None, counters: Tuple[str, ...] = ()) -> None:
        self.name, self.kind, self.target, self.factory = name, kind, target, factory
        self.params, self.when, self.counters = params, when, counters
        self.why, self.how, self.vllm, self.upstream, self.removal = (why, how, vllm, upstream,
                                                                      removal)

    @property
    def module(self) -> str:
        """The module the patch targets (hooked at import by the bootstrap)."""
        return self.target.split(":", 1)[0]

    @property
    def owner(self) -> str:
        """``Class`` of ``module:Class.attr`` or ``module:Class`` (methods, classes); the
        function of ``module:function``."""
        return self.target.split(":", 1)[1].rsplit(".", 1)[0]

    @property
    def attr(self) -> str:
        """``attr`` of ``module:Class.attr`` (methods); ``Class`` of ``module:Class``."""
        return self.target.split(":", 1)[1].rsplit(".", 1)[-1]

    def __repr__(self) -> str:
        return f"Patch({self.name!r}, {self.kind!r}, {self.target!r})"


PAGED_ATTN = "vllm.attention.ops.paged_attn"
XFORMERS = "vllm.attention.backends.xformers"
BACKEND_UTILS = "vllm.attention.backends.utils"
LOGITS = "vllm.model_executor.layers.logits_processor"
SEQUENCE = "vllm.sequence"
MODEL_RUNNER = "vllm.worker.model_runner"
SCHEDULER = "vllm.core.scheduler"
LLM_ENGINE = "vllm.engine.llm_engine"
MQ_CLIENT = "vllm.engine.multiprocessing.client"
PROTOCOL = "vllm.entrypoints.openai.protocol"
SERVING = "vllm.entrypoints.openai.serving_engine"
ASYNC_ENGINE = "vllm.engine.async_llm_engine"
LLM_ENTRY = "vllm.entrypoints.llm"
SERVING_CHAT = "vllm.entrypoints.openai.serving_chat"
HERMES = "vllm.entrypoints.openai.tool_parsers.hermes_tool_parser"
API_SERVER = "vllm.entrypoints.openai.api_server"
CLI_ARGS = "vllm.entrypoints.openai.cli_args"
