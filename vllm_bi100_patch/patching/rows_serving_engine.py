"""The serving rows of the patch table (``table.PATCHES``) for the engines' request intake,
guided decoding and tool calls of vLLM 0.6.3 (``serving/async_engine.py``,
``serving/llm_batch.py``, ``serving/guided_imports.py``, ``serving/guided.py``,
``serving/tool_stream.py``, ``serving/named_stream.py``, ``serving/hermes_cut.py``;
docs/serving-compat.md).  Data only, read at interpreter start: stdlib only.
"""

from __future__ import annotations

from .patch_row import (ASYNC_ENGINE, GUARD_IMPORT, HERMES, LLM_ENGINE, LLM_ENTRY, SERVING_CHAT,
                         WRAP_INSTANCE, Patch)

TYPE_CHECKING = False  # read at interpreter start: keep it bare
if TYPE_CHECKING:
    from typing import Tuple

_ON_063 = "vllm_bi100_patch.serving.seq_limit:on_063"
_VLLM_063 = ("0.6.3 (code checked against 0.6.3.post1, CoreX 3.2.3's being the same code; "
             "driven through vLLM's own {what} on both); not applied on other releases")
_GUIDED = "docs/serving-compat.md, \"Guided decoding\""

ROWS: Tuple[Patch, ...] = (
    Patch(
        "async_add_request", WRAP_INSTANCE, ASYNC_ENGINE + ":_AsyncLLMEngine.add_request_async",
        "vllm_bi100_patch.serving.async_engine:make_wrapper",
        params="code:vllm_bi100_patch.serving.async_engine:check", when=_ON_063,
        counters=("async_add_request",),
        why="`AsyncLLMEngine` (the server with `--disable-frontend-multiprocessing`, "
            "`run_batch`, library users) adds requests with its own copy of `add_request`, "
            "which the `LLMEngine` rows do not reach: a request with `n` over "
            "`max_num_seqs` is queued, ignored by the scheduler and answered with an empty "
            "text and `finish_reason: \"length\"`; a guided request whose logits processor "
            "cannot be built raises out of the engine loop, which catches only `ValueError`: "
            "the loop stops and every request in flight fails",
        how="the first is refused before it is queued with the `ValueError` of "
            "`seq_limit_engine`; the second becomes a `ValueError` naming the guide, the "
            "backend and the cause (`guided_decoding_errors`' message), which the engine loop "
            "hands to that request alone (a 400 where the front end has not answered yet); "
            "only where the method has the code shape it was checked against",
        vllm=_VLLM_063.format(what="`AsyncLLMEngine` with a stand-in executor"),
        upstream="vLLM pull request #9302 (0.6.4: parallel sampling as groups of one); the "
                 "guided-decoding exception: none (later releases build guides elsewhere)",
        removal="when the oldest vLLM the shim supports is 0.6.4"),
    Patch(
        "llm_batch_refusal", WRAP_INSTANCE, LLM_ENTRY + ":LLM._validate_and_add_requests",
        "vllm_bi100_patch.serving.llm_batch:make_wrapper",
        params="code:vllm_bi100_patch.serving.llm_batch:check", when=_ON_063,
        counters=("llm_batch_refusal",),
        why="`LLM.generate` adds a batch's requests one by one: when one is refused (n over "
            "`max_num_seqs`, a prompt too long, a guide that cannot be built), the requests "
            "before it stay queued and the next `generate()` returns their outputs mixed with "
            "its own",
        how="when the call raises, every request it queued is withdrawn "
            "(`LLMEngine.abort_request`, one WARNING naming them) and the refusal goes on "
            "unchanged; only where the method has the code shape it was checked against",
        vllm=_VLLM_063.format(what="`LLM` and `LLMEngine` with a stand-in executor"),
        upstream="none in 0.6.x (vLLM's V1 `LLM` validates a batch before adding it)",
        removal="when the oldest vLLM the shim supports has no V0 `LLM` engine (0.11)"),
    Patch(
        "guided_decoding_imports", GUARD_IMPORT, "pyairports.airports",
        "vllm_bi100_patch.serving.guided_imports:install",
        why="vLLM 0.6.3 builds guided decoding (`json_schema`, a named `tool_choice`, "
            "`guided_json`/`guided_regex`/`guided_choice`) with outlines 0.0.43 - 0.0.46, and "
            "`import outlines` imports `pyairports.airports`; pyairports was delisted from "
            "PyPI in 2025 and the name holds an unrelated 0.0.1 upload without that module: "
            "on a server installed today every guided request fails with "
            "`ModuleNotFoundError`",
        how="a `sys.meta_path` finder (last on the path: a real pyairports always wins) "
            "serves `pyairports` and `pyairports.airports` with `AIRPORT_LIST = []` when no "
            "other finder provides them, the installed outlines' only reader of the list "
            "(`outlines/types/airports.py`, an airport-code enum of its Python API) has the "
            "code shape it was checked against, and this vLLM uses outlines 0.0.x; one "
            "WARNING when it serves them. No schema, regex or choice vLLM compiles refers to "
            "the list: what they decode to is unchanged (" + _GUIDED + ")",
        vllm="0.5.0 - 0.6.4 (the releases on outlines 0.0.43 - 0.0.46; checked against "
             "outlines 0.0.46, which vLLM 0.6.3.post1 resolves to; proven through "
             "`LLMEngine.add_request` and `AsyncLLMEngine` on 0.6.3.post1 and CoreX 3.2.3)",
        upstream="outlines 0.1 replaced pyairports by airportsdata (outlines issue #1093), "
                 "used from vLLM 0.6.5; vLLM issue #23983 (0.6.3 cannot be installed as "
                 "released)",
        removal="when the oldest vLLM the shim supports is 0.6.5, or Iluvatar's build ships "
                "an outlines that does not import pyairports"),
    Patch(
        "guided_decoding_errors", WRAP_INSTANCE, LLM_ENGINE + ":LLMEngine._build_logits_processors",
        "vllm_bi100_patch.serving.guided:make_build_wrapper",
        params="code:vllm_bi100_patch.serving.guided:check_build", when=_ON_063,
        counters=("guided_decoding_errors",),
        why="`LLMEngine.add_request` builds a guided request's logits processor and lets "
            "whatever the backend raises out (`ModuleNotFoundError` without pyairports, an "
            "error of a schema the backend cannot compile): the OpenAI front end answers only "
            "a `ValueError` with a 400, so the client gets a 500 or a stream cut short",
        how="an exception raised while the guided-decoding backend builds the processor "
            "(a frame of vLLM's guided_decoding package, outlines, lm-format-enforcer, "
            "interegular, lark) becomes `GuidedDecodingUnavailable`, a `ValueError` naming "
            "the guide, the backend and the cause (with the remedy where it is pyairports); "
            "vLLM's own `ValueError`s pass unchanged; one WARNING; only where the method has "
            "the code shape it was checked against",
        vllm=_VLLM_063.format(what="`LLMEngine.add_request`"),
        upstream="none in 0.6.x",
        removal="when the oldest vLLM the shim supports is 0.6.5 (guides built in the front "
                "end, whose errors are 400s)"),
    Patch(
        "hermes_tool_start", WRAP_INSTANCE,
        HERMES + ":Hermes2ProToolParser.extract_tool_calls_streaming",
        "vllm_bi100_patch.serving.tool_stream:make_parser_wrapper",
        params="code:vllm_bi100_patch.serving.tool_stream:check_parser", when=_ON_063,
        counters=("hermes_tool_start",),
        why="with `--tool-call-parser hermes`, every streamed tool call whose `<tool_call>` "
            "token arrives as its own delta (the usual case) logs `AttributeError: "
            "'NoneType' object has no attribute 'get'` with a traceback: the parser opens the "
            "call, parses nothing, and reads the name of None",
        how="for exactly that delta, the parser's own state updates of the branch (the new "
            "tool's index, its name not sent, an empty arguments slot) and None, as vLLM "
            "0.6.5 returns; every other delta goes to the original (while row "
            "`hermes_tool_args` is installed, every delta is answered by its streaming "
            "instead); only where the method has the code shape it was checked against "
            "(0.6.3.post1's, and the vendored CoreX tree's, which logs with `logger.error`)",
        vllm="0.6.3 (code checked against 0.6.3.post1 and the vendored CoreX 3.2.3 tree's "
             "parser; driven through vLLM's own OpenAI server app (`--enable-auto-tool-choice "
             "--tool-call-parser hermes`) on 0.6.3.post1 and on the stand-in, which keeps "
             "0.6.3.post1's parser); not applied on other releases",
        upstream="vLLM pull request #10398 (\"Fix hermes tool parser output error stream "
                 "arguments in some cases\", `if current_tool_call is None: return None`), "
                 "in 0.6.5",
        removal="when the oldest vLLM the shim supports is 0.6.5"),
    Patch(
        "stream_finish_reason", WRAP_INSTANCE,
        SERVING_CHAT + ":OpenAIServingChat.chat_completion_stream_generator",
        "vllm_bi100_patch.serving.tool_stream:make_stream_wrapper",
        params="code:vllm_bi100_patch.serving.tool_stream:check_stream", when=_ON_063,
        counters=("stream_finish_reason", "stream_cut_tool_call", "stream_usage_summed"),
        why="a streamed chat completion skips an output the tool parser has nothing to send "
            "for before it looks at `finish_reason`: when that is the last output (a tool "
            "call cut short by `max_tokens`), the stream ends without any chunk carrying a "
            "`finish_reason`, which OpenAI clients need to end a turn",
        how="the engine's outputs and the chunks are watched; a choice that finished without "
            "a finish chunk gets one (empty delta, usage where the request asks for it on "
            "every chunk) before the usage chunk and `[DONE]`, with the engine's "
            "`finish_reason` (`length` when cut, as the unstreamed answer says; `tool_calls` "
            "where calls were streamed and the model stopped); a stream ended by an error "
            "chunk is left as it is; on CoreX 3.2.3's file (0.6.2's usage code), where `n` > "
            "1 the final usage chunk gets the sum of every choice's tokens, not the last "
            "choice's; only where the method has one of the code shapes it was checked "
            "against (0.6.3.post1's, the vendored CoreX tree's)",
        vllm="0.6.3 (code checked against 0.6.3.post1 and CoreX 3.2.3's vendored "
             "`serving_chat.py`; driven through vLLM's own OpenAI server app "
             "(`--enable-auto-tool-choice --tool-call-parser hermes`) on 0.6.3.post1 and on "
             "the stand-in, which has the vendor's file); not applied on other releases",
        upstream="later vLLM sends the finish chunk with an empty delta (`if delta_message "
                 "is None: ... delta_message = DeltaMessage()` in "
                 "`vllm/entrypoints/openai/serving_chat.py`, e.g. at commit 003fe59); not in "
                 "0.6.x (0.6.6.post1 still `continue`s)",
        removal="when the oldest vLLM the shim supports sends the finish chunk itself"),
    Patch(
        "named_tool_stream", WRAP_INSTANCE,
        SERVING_CHAT + ":OpenAIServingChat.chat_completion_stream_generator",
        "vllm_bi100_patch.serving.tool_stream:make_stream_wrapper",
        params="code:vllm_bi100_patch.serving.tool_stream:check_stream", when=_ON_063,
        counters=("named_tool_stream",),
        why="a streamed tool call forced by a named `tool_choice` (`{\"type\": \"function\", "
            "\"function\": {\"name\": ...}}`) repeats the name in every delta, has no `id` "
            "and no `type`, and with `n` > 1 gives choice 1's call `index: 1`: the openai "
            "SDK's `chat.completions.stream()` joins the name over and over with `id=None` "
            "(a strict `pydantic_function_tool` gets no `parsed_arguments`, `n=2` an "
            "`IndexError`), LangChain's streamed `with_structured_output(method="
            "\"function_calling\")` and `bind_tools(tool_choice=...)` find an unknown tool "
            "`WeatherWeather...`, strands-agents' structured output finds no call id",
        how="the chunks of such a stream are rewritten (`serving/named_stream.py`): per "
            "choice, the call's first delta carries an `id` (`chatcmpl-tool-...`), `\"type\": "
            "\"function\"` and the name, later deltas only the arguments (their text "
            "untouched), `index` 0 (the call's index within its choice); `finish_reason` as "
            "0.6.3 sends it (the engine's: `stop`, `length` when cut; upstream and OpenAI "
            "answer a named call with `stop`); other requests' chunks are not read. The "
            "rewriting runs in the wrapper `stream_finish_reason` installs on the same method "
            "(one wrapper, installed by whichever of the two rows is enabled, doing what each "
            "enabled row does); only where the method has one of the code shapes it was "
            "checked against (0.6.3.post1's, the vendored CoreX tree's)",
        vllm="0.6.3 (code checked against 0.6.3.post1 and CoreX 3.2.3's vendored "
             "`serving_chat.py`; driven through vLLM's own OpenAI server app on 0.6.3.post1 "
             "and on the stand-in, which has the vendor's file; proven with the openai SDK, "
             "LangChain and strands-agents); not applied on other releases",
        upstream="later vLLM sends the name with an id and type once (the "
                 "`function_name_returned` flags of `serving_chat.py`'s named branch, `index` "
                 "still the choice's); pull request #41876 (2026) streams named and required "
                 "`tool_choice` through one parser (name and id once on the first tool-call "
                 "chunk)",
        removal="when the oldest vLLM the shim supports streams a named call with its id "
                "once and index 0"),
    Patch(
        "hermes_tool_args", WRAP_INSTANCE,
        SERVING_CHAT + ":OpenAIServingChat._should_check_for_unstreamed_tool_arg_tokens",
        "vllm_bi100_patch.serving.hermes_args:make_finish_wrapper",
        params="code:vllm_bi100_patch.serving.hermes_args:check",
        when="vllm_bi100_patch.serving.hermes_args:args_needed",
        counters=("hermes_tool_args", "hermes_finish_kept"),
        why="with `--tool-call-parser hermes`, the concatenated `function.arguments` deltas of "
            "a streamed tool call are not the JSON the model wrote (LangChain "
            "`bind_tools(...).stream`, openai-agents `Runner.run_streamed`: "
            "`'{\"city\": \"city'`), or are empty when the call's JSON comes in one delta "
            "(an `IndexError` logged), whatever the delta size: 0.6.3's parser streams "
            "differences of `json.dumps` of `partial_json_parser`'s completions of the text "
            "(an unfinished string is closed), and the front end replaces the finishing "
            "chunk's delta by `json.dumps(the parsed arguments).replace(what was streamed, "
            "\"\", 1)`: the last `}` or the whole arguments lost or doubled, the name and "
            "content of that delta dropped",
        how="the hermes parser's wrapper (`hermes_tool_start`'s) streams every delta itself "
            "while this row is installed: each choice's text read once as it grows, the "
            "text before the calls as content, each call's name once (with its id, in the "
            "first delta of its index), its arguments' raw text as the model writes it, "
            "never a character past the value (the concatenation is the model's JSON text, "
            "which parses to what the unstreamed answer parses to), the parser's state kept "
            "for the front end as 0.6.3 keeps it (`finish_reason: \"tool_calls\"`); this "
            "method answers False for those deltas, so the finishing chunk keeps its delta; "
            "only where the method has the code shape it was checked against",
        vllm=_VLLM_063.format(what="OpenAI server app (`--enable-auto-tool-choice "
                                   "--tool-call-parser hermes`), every split of the output "
                                   "into deltas"),
        upstream="none in 0.6.x, none complete later: the parser kept diffing completions "
                 "(0.6.5's change for vLLM issue #10395, `hermes_tool_start`'s pull request; "
                 "merged #22002 for non-string values; issue #32152, the last brace lost when "
                 "deltas hold several tokens, and issue #28806, empty arguments, open or fixed "
                 "by closed pull requests #36360, #37098); the finishing branch kept its "
                 "`replace` (merged #31438 keeps the call's id and name, #44017 moved the flush "
                 "into the parsers; #39615, arguments blanked when a call comes in one delta, "
                 "closed); the hermes parser's rewrite: #51937 (open)",
        removal="when the oldest vLLM the shim supports streams hermes arguments as written"),
    Patch(
        "hermes_cut_call", WRAP_INSTANCE, HERMES + ":Hermes2ProToolParser.extract_tool_calls",
        "vllm_bi100_patch.serving.hermes_cut:make_wrapper",
        params="code:vllm_bi100_patch.serving.hermes_cut:check", when=_ON_063,
        counters=("hermes_cut_call",),
        why="with `--tool-call-parser hermes`, an unstreamed answer whose tool call was cut by "
            "`max_tokens` is right (the output as content, `tool_calls: []`, `finish_reason: "
            "\"length\"`), but the parser logs `ERROR Error in extracting tool call from "
            "response` with a `JSONDecodeError` traceback (CoreX 3.2.3's vendored parser: the "
            "ERROR line with its message) for every such request: a normal truncation fills "
            "the operator's log with errors",
        how="where the output's last `<tool_call>` is unclosed, the text after it is empty or "
            "an unfinished JSON document (closing its string and brackets makes it JSON) and "
            "every closed call before it is a JSON object with a name and arguments, the "
            "parser's answer for it (no calls, the whole output as content) is given without "
            "calling it, with one INFO line; every other output goes to the original, so a "
            "malformed call (broken JSON in a closed call, text after a call's JSON) still "
            "logs 0.6.3's ERROR; only where the method has one of the code shapes it was "
            "checked against (0.6.3.post1's, the vendored CoreX tree's)",
        vllm=_VLLM_063.format(what="OpenAI server app (`--enable-auto-tool-choice "
                                   "--tool-call-parser hermes`), unstreamed"),
        upstream="none in 0.6.x; later vLLM's hermes parser still logs the exception "
                 "(`logger.exception(\"Error in extracting tool call from response.\")`)",
        removal="when the oldest vLLM the shim supports reads a cut call without an error"),
)
