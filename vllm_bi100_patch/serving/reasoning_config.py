"""Which OpenAI servers split reasoning output (``serving/reasoning.py``), and how an operator
says so: upstream's ``vllm serve`` flags on vLLM 0.6.3's command line (row
``reasoning_flags``: ``--enable-reasoning``, ``--reasoning-parser NAME``), or
``VLLM_BI100_REASONING_PARSER`` where a flag cannot be added (the shim activated after the
command line was parsed: vLLM's plugin entry point).  Row ``reasoning_parser`` reads them when
``init_app_state`` builds an app's serving classes and remembers the parser of that app's
``OpenAIServingChat`` (``parser_of``).

Upstream's rules: ``--reasoning-parser`` names the parser (``deepseek_r1``, ``qwen3``);
``--enable-reasoning`` without one is an error (0.7's rule; later releases dropped the flag and
turn reasoning on with the parser alone, which is accepted too).  A parser the shim does not
serve stops the server at start with an error naming the served ones.  Never imports vLLM.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from ..activation import config
from ..activation.log import log
from ..patching import code_shapes
from ..patching.factories import Wrapper
from ..patching.versions import Family

#: The parsers served, each with the upstream change it backports.
PARSERS: Dict[str, str] = {
    "deepseek_r1": "vLLM pull request #12473 (`--enable-reasoning --reasoning-parser "
                   "deepseek_r1`, 0.7.1)",
    "qwen3": "vLLM pull request #17466 (the `qwen3` parser, 0.8.5)",
}
assert tuple(PARSERS) == config.REASONING_PARSERS

#: ``OpenAIServingChat`` instance -> its parser (the apps that asked for one).
_parsers: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()

FLAGS_KNOWN = {"81a35abea9c98365": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree"}
STATE_PARAMS = ("engine_client", "model_config", "state", "args")
STATE_KNOWN = {"36a95187ee95ae8a": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree"}


def parser_of(serving: Any) -> Optional[str]:
    """The reasoning parser of the app whose chat serving class is ``serving`` (None: off)."""
    try:
        return _parsers.get(serving)
    except TypeError:
        return None


def chosen(args: Any, settings: config.Settings) -> Optional[str]:
    """The parser ``args`` (or the environment) asks for; raises ``ValueError`` naming what is
    wrong."""
    name = getattr(args, "reasoning_parser", None) or settings.reasoning_parser
    if name is None:
        if getattr(args, "enable_reasoning", False):
            raise ValueError("--enable-reasoning needs --reasoning-parser (one of "
                             f"{', '.join(PARSERS)}) or {config.REASONING_PARSER}")
        return None
    if name not in PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not served by vllm-bi100-patch on "
                         f"vLLM 0.6.3 (served: {', '.join(PARSERS)})")
    return name


def check_flags(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "make_arg_parser", ("parser",), FLAGS_KNOWN)


def check_state(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "init_app_state", STATE_PARAMS, STATE_KNOWN)


def _has(parser: Any, flag: str) -> bool:
    return flag in getattr(parser, "_option_string_actions", {})


def make_flags_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                       settings: config.Settings) -> Wrapper:
    def make_arg_parser(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                        kwargs: Dict[str, Any]) -> Any:
        parser = wrapped(*args, **kwargs)
        if not _has(parser, "--enable-reasoning"):
            parser.add_argument(
                "--enable-reasoning", action="store_true", default=False,
                help="[vllm-bi100-patch] return the model's thinking as reasoning_content "
                     "(needs --reasoning-parser)")
        if not _has(parser, "--reasoning-parser"):
            parser.add_argument(
                "--reasoning-parser", type=str, choices=list(PARSERS), default=None,
                help="[vllm-bi100-patch] the reasoning parser: " + ", ".join(PARSERS))
        return parser

    return make_arg_parser


def make_state_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                       settings: config.Settings) -> Wrapper:
    def init_app_state(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                       kwargs: Dict[str, Any]) -> Any:
        values = dict(zip(STATE_PARAMS, args), **kwargs)
        name = chosen(values.get("args"), settings)  # before the app is set up: fail early
        result = wrapped(*args, **kwargs)
        serving = getattr(values.get("state"), "openai_serving_chat", None)
        if name is not None and serving is not None:
            _parsers[serving] = name
            log.info("vllm-bi100-patch: reasoning parser %s: the thinking before </think> is "
                     "returned as reasoning_content (row reasoning_parser)", name)
        return result

    return init_app_state


__all__ = ["PARSERS", "check_flags", "check_state", "chosen", "make_flags_wrapper",
           "make_state_wrapper", "parser_of"]
