"""The serving rows of the patch table (``table.PATCHES``): every row whose factory lives in
the ``serving`` room, in table order.

One concept: what the shim patches in how vLLM 0.6.x takes a request in and answers it -- the
V0 scheduler's queue and the engines' request intake (``serving/seq_limit.py``,
``serving/async_engine.py``, ``serving/llm_batch.py``), guided decoding
(``serving/guided_imports.py``, ``serving/guided.py``) and the OpenAI front end (request bodies,
tool choice and tool calls, hermes streaming, completions, error messages:
``serving/chat_compat.py``, ``serving/tool_stream.py``, ``serving/named_stream.py``,
``serving/hermes_cut.py``, ...; ``docs/serving-compat.md``).  One module, because the table's
order (which ``docs/patches.md`` and the hooked modules follow) interleaves these sub-topics:
a module per sub-topic would reorder the table.  Data only,
read at interpreter start: stdlib only.
"""

from __future__ import annotations

from .patch_row import (API_SERVER, ASYNC_ENGINE, CLI_ARGS, GUARD_IMPORT, HERMES, LLM_ENGINE,
                         LLM_ENTRY, MQ_CLIENT, PROTOCOL, REPLACE_CLASS, REPLACE_FUNCTION, SCHEDULER, SERVING,
                         SERVING_CHAT, WRAP_INSTANCE, Patch)

TYPE_CHECKING = False  # read at interpreter start: keep it bare
if TYPE_CHECKING:
    from typing import Tuple

_SEQ_LIMIT_VLLM = ("0.6.3 (code checked against 0.6.3.post1, CoreX 3.2.3's being the same code; "
                   "driven through vLLM's `Scheduler` and 0.6.3's OpenAI server app on both); "
                   "not applied from 0.6.4 (parallel sampling as groups of one)")
_SEQ_LIMIT_UPSTREAM = ("vLLM pull request #9302 (parallel sampling as separate sequence groups of "
                       "one: `ParallelSampleSequenceGroup`), in 0.6.4")
_SEQ_LIMIT_REMOVAL = ("when the oldest vLLM the shim supports is 0.6.4, or Iluvatar's build "
                      "carries `ParallelSampleSequenceGroup` (the row then reports itself not "
                      "needed)")

_ON_063 = "vllm_bi100_patch.serving.seq_limit:on_063"
_VLLM_063 = ("0.6.3 (code checked against 0.6.3.post1, CoreX 3.2.3's being the same code; "
             "driven through vLLM's own {what} on both); not applied on other releases")
_GUIDED = "docs/serving-compat.md, \"Guided decoding\""

#: The reasoning rows' (``serving/reasoning.py``, ``serving/reasoning_config.py``).
_REASONING_UPSTREAM = "vLLM pull requests #12473 (0.7.1), #17466 (`qwen3`, 0.8.5)"
_REASONING_VLLM = ("0.6.3 (code checked against 0.6.3.post1 and CoreX 3.2.3's vendored "
                   "`serving_chat.py`; driven through 0.6.3's app on both); not applied on "
                   "other releases")

ROWS: Tuple[Patch, ...] = (
    Patch(
        "unschedulable_group", WRAP_INSTANCE, SCHEDULER + ":Scheduler._schedule_prefills",
        "vllm_bi100_patch.serving.seq_limit:make_scheduler_wrapper",
        params="code:vllm_bi100_patch.serving.seq_limit:check_scheduler",
        when="vllm_bi100_patch.serving.seq_limit:limit_needed",
        counters=("unschedulable_group",),
        why="a request asking for more parallel sequences (`n`, or `best_of`) than "
            "`--max-num-seqs` can never be scheduled, and `_schedule_prefills` `break`s on "
            "the head of the waiting queue when it does not fit the budget: that request and "
            "every request behind it wait forever (one client stops the server; `n=2` under "
            "`--max-num-seqs 1`, `n=257` under the default 256), with chunked prefill on or off",
        how="before the original runs, every group of the waiting queue (not only its head: "
            "the loop skips a head waiting for a LoRA slot and would break on a group behind "
            "it) whose `get_max_num_running_seqs()` exceeds `max_num_seqs` leaves the queue "
            "as ignored (`FINISHED_IGNORED`, returned in `ignored_seq_groups`, one WARNING "
            "naming the request, n and max_num_seqs), as vLLM does for a prompt over the "
            "limit; the requests behind it are scheduled. The other `break`s of the loop "
            "(allocation `LATER`, an exhausted budget, the delay) pass once running requests "
            "finish; only where the method has the code shape it was checked against",
        vllm=_SEQ_LIMIT_VLLM, upstream=_SEQ_LIMIT_UPSTREAM, removal=_SEQ_LIMIT_REMOVAL),
    Patch(
        "seq_limit_engine", WRAP_INSTANCE, LLM_ENGINE + ":LLMEngine.add_request",
        "vllm_bi100_patch.serving.seq_limit:make_add_request_wrapper",
        params="code:vllm_bi100_patch.serving.seq_limit:check_add_request",
        when="vllm_bi100_patch.serving.seq_limit:limit_needed",
        counters=("seq_limit_engine",),
        why="`LLMEngine.add_request` queues a request whose `n`/`best_of` exceeds "
            "`max_num_seqs` although the scheduler can never run it",
        how="refuses it before it is queued: `ValueError` naming the request, n (and "
            "best_of) and max_num_seqs (vLLM's front end turns a `ValueError` into a 400); "
            "only where the method has the code shape it was checked against",
        vllm=_SEQ_LIMIT_VLLM, upstream=_SEQ_LIMIT_UPSTREAM, removal=_SEQ_LIMIT_REMOVAL),
    Patch(
        "seq_limit_client", WRAP_INSTANCE, MQ_CLIENT + ":MQLLMEngineClient.__init__",
        "vllm_bi100_patch.serving.seq_limit_front:make_client_wrapper",
        params="code:vllm_bi100_patch.serving.seq_limit_front:check_client",
        when="vllm_bi100_patch.serving.seq_limit:limit_needed",
        counters=("seq_limit_client",),
        why="the OpenAI server's default front end (a separate process from the engine) does "
            "not know `max_num_seqs`: a chat or completion request whose `n`/`best_of` "
            "exceeds it is accepted, a stream answered 200, before the engine refuses it",
        how="the front end's engine client reads `scheduler_config.max_num_seqs` from the "
            "engine configuration it is built with, and its `generate` refuses such a "
            "request with the `ValueError` of `seq_limit_engine`, which vLLM's serving "
            "classes answer with a 400 before any stream starts; the check is this row's "
            "alone (its kill switch turns off nothing else)",
        vllm=_SEQ_LIMIT_VLLM, upstream=_SEQ_LIMIT_UPSTREAM, removal=_SEQ_LIMIT_REMOVAL),
    Patch(
        "seq_limit_openai", WRAP_INSTANCE, SERVING + ":OpenAIServing._check_model",
        "vllm_bi100_patch.serving.seq_limit_front:make_check_model_wrapper",
        params="code:vllm_bi100_patch.serving.seq_limit_front:check_check_model",
        when="vllm_bi100_patch.serving.seq_limit:limit_needed",
        counters=("seq_limit_openai",),
        why="with the engine in the front end's own process (`--disable-frontend-"
            "multiprocessing`), the OpenAI server accepts a chat or completion request whose "
            "`n`/`best_of` exceeds `max_num_seqs` (a stream is answered 200 before the "
            "engine refuses it)",
        how="after the model check, such a request gets a 400 naming n (or best_of) and "
            "max_num_seqs before anything is queued; the limit is the in-process engine's "
            "(the default front end's client refuses on its own: `seq_limit_client`)",
        vllm=_SEQ_LIMIT_VLLM, upstream=_SEQ_LIMIT_UPSTREAM, removal=_SEQ_LIMIT_REMOVAL),
    Patch(
        "chat_request_compat", REPLACE_CLASS, PROTOCOL + ":ChatCompletionRequest",
        "vllm_bi100_patch.serving.chat_compat:make_request_class",
        params="code:vllm_bi100_patch.serving.chat_compat:check",
        when="vllm_bi100_patch.serving.chat_compat:compat_needed",
        counters=("chat_request_compat", "chat_fields_ignored"),
        why="vLLM 0.6.3's chat request (`extra=\"forbid\"`, CoreX 3.2.3's is the same file) "
            "refuses what today's OpenAI clients and agent frameworks send "
            "(`max_completion_tokens`, `store`, `metadata`, `tools[].function.strict`, "
            "`tool_choice: \"required\"` or `\"none\"`, an echoed `reasoning_content` in a "
            "message, object-form tool-call arguments, `top_logprobs: 0`), answers a 500 to "
            "any `tool_choice` object but the named form (`KeyError: 'function'`) and to "
            "some malformed or deeply nested bodies, ignores `response_format: json_schema` "
            "(output unconstrained), streams usage on every chunk, and gives the `developer` "
            "role to the chat template as is",
        how="a subclass with one pydantic wrap validator rewrites the request body before "
            "0.6.3's own validation, lossless mappings only, copying only what it changes "
            "(docs/serving-compat.md): `max_completion_tokens` -> `max_tokens` (wins, "
            "#9837; an invalid one refused by that name); harmless fields (`store`, "
            "`metadata`, `service_tier`, `prompt_cache_key`, `safety_identifier`, "
            "`prediction`, `prompt_cache_retention`, `prompt_cache_options`, "
            "`stream_options.include_obfuscation`, `modalities: [\"text\"]`) and unknown "
            "message keys dropped, each named once in a WARNING over a bounded set of names, "
            "escaped (#10463); `strict` true/false dropped (#10463; a strict tool's calls are "
            "checked by `chat_tool_calls`), any other value a 400; `tool_choice: \"none\"` "
            "drops the tools (#10000), `\"required\"` -> `guided_json` of one schema "
            "accepting a call of any tool (#13483's shape; one call if `parallel_tool_calls` is "
            "false), `allowed_tools` -> the allowed "
            "`tools` and its mode, the Responses API's `{\"type\": \"function\", \"name\"}` "
            "-> the named form, any other object a 400 naming it; a forced tool beside "
            "`guided_json` or `response_format` a 400; object arguments -> their JSON text "
            "(invalid JSON text a 400 naming where); `json_schema` (object or JSON text) -> "
            "`guided_json` (#9530); every client schema something reads (strict, named and "
            "`required` tools, `json_schema`, `guided_json`) resolved only within itself and "
            "within size, depth and pattern limits, else a 400 naming it (never retrieved); "
            "`{}` and a named tool without parameters guided as JSON objects; "
            "`continuous_usage_stats` false unless asked (0.6.4); "
            "`developer` -> `system`; `top_logprobs: 0` without `logprobs` dropped; "
            "`messages: []` and `reasoning_effort`, `verbosity`, `audio`, other modalities a "
            "400 naming them; what 0.6.3's validators crash on (`TypeError`, `KeyError`, "
            "`RecursionError`) a 400 naming the exception; every other unknown field stays "
            "refused by name. The subclass replaces the class wherever vLLM bound it (other "
            "modules' names, the API server's endpoint annotations, `BatchRequestInput.body` "
            "of `run_batch`; `status()` counts the routes of an app built before activation, "
            "which it cannot reach); revert puts every original back",
        vllm="0.6.3 (code checked against 0.6.3.post1, CoreX 3.2.3's being byte-identical; "
             "proven with the `openai` client against 0.6.3's own server app on both); not "
             "applied from 0.6.4 (`max_completion_tokens` is a field there)",
        upstream="vLLM pull requests #9837, #10000, #9530 (0.6.4), #10463 (0.6.5), #13483 "
                 "(`required`, 0.8.3); the `developer` role, object arguments, "
                 "`allowed_tools`: none",
        removal="when the oldest vLLM the shim supports is 0.8.3"),
    Patch(
        "completion_request_compat", REPLACE_CLASS, PROTOCOL + ":CompletionRequest",
        "vllm_bi100_patch.serving.completion_compat:make_request_class",
        params="code:vllm_bi100_patch.serving.completion_compat:check",
        when="vllm_bi100_patch.serving.chat_compat:compat_needed",
        counters=("completion_request_compat", "completion_fields_ignored"),
        why="vLLM 0.6.3's completion request (`/v1/completions`) streams usage on every chunk "
            "when `stream_options.include_usage` is sent, accepts `response_format: "
            "json_schema` and ignores the schema (output unconstrained), and refuses "
            "`stream_options.include_obfuscation`, `prompt_cache_retention` and "
            "`prompt_cache_options`, which change nothing it answers",
        how="a subclass with one pydantic wrap validator (the chat row's kind) rewrites the "
            "body: `continuous_usage_stats` false unless asked (usage on the final chunk "
            "only, 0.6.4's default); `json_schema` (object or JSON text) -> `guided_json` "
            "(0.6.3's own guided decoding; a different `guided_json` beside it a 400); its "
            "schema and `guided_json` resolved only within themselves and within limits "
            "(else a 400 naming it), `{}` guided as a JSON object; the "
            "three harmless fields dropped, each named once in a WARNING; what 0.6.3's "
            "validators crash on a 400 naming the exception",
        vllm="0.6.3 (code checked against 0.6.3.post1, CoreX 3.2.3's being byte-identical; "
             "proven with the `openai` client against 0.6.3's own server app on both); not "
             "applied where the chat row is not needed",
        upstream="vLLM 0.6.4 (default `continuous_usage_stats` false); `json_schema` on "
                 "completions: later releases (the chat form, #9530, in 0.6.4)",
        removal="with `chat_request_compat`"),
    Patch(
        "chat_tool_calls", WRAP_INSTANCE,
        SERVING_CHAT + ":OpenAIServingChat.create_chat_completion",
        "vllm_bi100_patch.serving.tool_calls:make_create_wrapper",
        params="code:vllm_bi100_patch.serving.tool_calls:check_create",
        when="vllm_bi100_patch.serving.tool_calls:tool_calls_needed",
        counters=("tool_choice_required", "tool_arguments_invalid", "tool_arguments_unchecked"),
        why="vLLM 0.6.3 cannot answer `tool_choice: \"required\"` (agent frameworks' "
            "structured output: pydantic-ai's `output_type`), and nothing checks the calls of "
            "a tool sent with `strict: true` under automatic tool choice (openai-agents and "
            "pydantic-ai send every tool so)",
        how="wraps `create_chat_completion` for the requests the chat row gave a tool plan: "
            "a `required` answer (guided by the calls' schema, seen by 0.6.3 as text) is read "
            "as the call array and returned as `tool_calls` with `finish_reason: "
            "\"tool_calls\"`, streamed one delta per call as each completes (a cut answer "
            "keeps its unfinished part as content); every call of a strict tool (auto, named "
            "or required; streamed or not) is checked against the tool's schema (jsonschema "
            "without retrieval, patterns by the regex engine under a 0.5 s budget, OpenAI's "
            "strict formats, in threads off the event loop; over budget: counted unchecked): "
            "a violation is one WARNING naming the request and tool and one count of "
            "`vllm_bi100:tool_arguments_invalid_total`, the answer unchanged (as upstream "
            "serves strict tools); requests without a plan pass through untouched",
        vllm="0.6.3 (code checked against 0.6.3.post1 and the serving_chat.py of CoreX "
             "3.2.3's vendored tree; proven on 0.6.3.post1's app and on the stand-in's, which "
             "has the vendor's file); not applied where the chat row is not, or is disabled",
        upstream="vLLM pull request #13483 (`required` through guided decoding, 0.8.3); "
                 "strict tools: accepted unchecked from 0.6.5 (#10463)",
        removal="with `chat_request_compat`"),
    Patch(
        "responses_api", REPLACE_FUNCTION, API_SERVER + ":build_app",
        "vllm_bi100_patch.serving.responses_route:make_build_app_wrapper",
        params="code:vllm_bi100_patch.serving.responses_route:check",
        when="vllm_bi100_patch.serving.responses_route:responses_needed",
        counters=("responses_api", "responses_refused", "responses_hosted_tools"),
        why="vLLM 0.6.3 answers OpenAI's Responses API (`POST /v1/responses`) with a 404: "
            "Codex (`@openai/codex`) speaks only it, and openai-agents' default model, "
            "pydantic-ai's `OpenAIResponsesModel`, LangChain's `use_responses_api` and the "
            "Vercel AI SDK's `@ai-sdk/openai` provider send it",
        how="every app `build_app` builds gets the route: the request is read as the chat "
            "completion it asks for (`instructions` and `input` items as messages, function "
            "tools, `tool_choice`, `max_output_tokens`, `text.format`; docs/serving-compat.md "
            "lists each field served, mapped or refused by name), validated by the app's own "
            "chat request class (the chat row's mappings, refusals and schema limits apply), "
            "answered by `OpenAIServingChat.create_chat_completion` with every serving row on "
            "it, and written back as a Responses object (`output` items: reasoning, message, "
            "function_call; `status` `incomplete` when `max_output_tokens` cut it; usage) or "
            "as its event stream (`response.created` ... `response.completed`); output items "
            "kept in a bounded in-memory store for `item_reference` (the Vercel AI SDK's "
            "multi-turn default; not with `store: false`); `previous_response_id`, "
            "`background`, custom tools and stored prompts refused by name (a 400); hosted "
            "tools offered (Codex offers `web_search`) left out of what the model sees, with "
            "one WARNING; an app built before activation has no route, one built before "
            "revert keeps it",
        vllm="0.6.3 (code checked against 0.6.3.post1, CoreX 3.2.3's `api_server.py` being "
             "0.6.3's; proven with the openai SDK, openai-agents, pydantic-ai, LangChain, the "
             "Vercel AI SDK and Codex against 0.6.3's own app and the stand-in's); not applied "
             "where the app serves the route itself",
        upstream="vLLM pull request #20504 (`/v1/responses`, 0.10.0, stateless; `store` and "
                 "`previous_response_id` later)",
        removal="when the oldest vLLM the shim supports is 0.10.0"),
    Patch(
        "reasoning_flags", REPLACE_FUNCTION, CLI_ARGS + ":make_arg_parser",
        "vllm_bi100_patch.serving.reasoning_config:make_flags_wrapper",
        params="code:vllm_bi100_patch.serving.reasoning_config:check_flags",
        when=_ON_063, counters=(),
        why="upstream's `vllm serve --enable-reasoning --reasoning-parser deepseek_r1` (0.7; "
            "`qwen3` from 0.8.5) is refused by vLLM 0.6.3's command line (`unrecognized "
            "arguments`): the thinking of Qwen3 and DeepSeek-R1 models stays in `content`",
        how="the parser `make_arg_parser` returns gets the two flags where it has none "
            "(`--reasoning-parser` with the choices `deepseek_r1`, `qwen3`); nothing else "
            "on the command line changes; a process whose parser was built before activation "
            "(vLLM's plugin entry point) uses `VLLM_BI100_REASONING_PARSER` instead",
        vllm="0.6.3 (code checked against 0.6.3.post1, CoreX 3.2.3's `cli_args.py` being "
             "0.6.3's); not applied on other releases",
        upstream=_REASONING_UPSTREAM,
        removal="when the oldest vLLM the shim supports is 0.8.5"),
    Patch(
        "reasoning_parser", REPLACE_FUNCTION, API_SERVER + ":init_app_state",
        "vllm_bi100_patch.serving.reasoning_config:make_state_wrapper",
        params="code:vllm_bi100_patch.serving.reasoning_config:check_state",
        when=_ON_063, counters=(),
        why="the flags of `reasoning_flags` (or `VLLM_BI100_REASONING_PARSER`) must reach the "
            "app they configure",
        how="before the original builds the serving classes, the parser asked for is checked "
            "(`--enable-reasoning` without a parser, or a parser not served, stops the "
            "server at start with an error naming the served ones); after, the app's "
            "`OpenAIServingChat` is remembered with its parser (one INFO line); rows "
            "`reasoning_output` and `reasoning_stream` split the answers of that app only",
        vllm="0.6.3 (code checked against 0.6.3.post1, CoreX 3.2.3's `api_server.py` being "
             "0.6.3's); not applied on other releases",
        upstream="vLLM pull request #12473 (0.7.1)",
        removal="with `reasoning_flags`"),
    Patch(
        "reasoning_output", WRAP_INSTANCE,
        SERVING_CHAT + ":OpenAIServingChat.chat_completion_full_generator",
        "vllm_bi100_patch.serving.reasoning:make_full_wrapper",
        params="code:vllm_bi100_patch.serving.reasoning:check_full",
        when=_ON_063,
        counters=("reasoning_output",),
        why="on vLLM 0.6.3 a reasoning model's `<think>...</think>` arrives inside `content` "
            "(a small `max_tokens` returns only thinking; a client that parses the content "
            "reads the thinking as the answer) and the tool parser reads calls inside it",
        how="for an app with a reasoning parser (`reasoning_parser`), the engine's output is "
            "split before 0.6.3 reads it (`serving/reasoning.py`): the answer after "
            "`</think>` is what the tool parser and `content` get, the thinking goes to "
            "`message.reasoning_content` (`deepseek_r1`: everything before `</think>`; "
            "`qwen3`: only a closed leading `<think>` block), token counts unchanged; a "
            "guided request (structured output, a named or `required` tool, `guided_*`) is "
            "not split: 0.6.3's guide applies from the first token, so the model writes no "
            "thinking; apps without a parser pass through untouched",
        vllm=_REASONING_VLLM, upstream=_REASONING_UPSTREAM,
        removal="with `reasoning_flags`"),
    Patch(
        "error_message_cause", WRAP_INSTANCE, SERVING + ":OpenAIServing.create_error_response",
        "vllm_bi100_patch.serving.error_cause:make_error_wrapper",
        params="code:vllm_bi100_patch.serving.error_cause:check_error",
        when="vllm_bi100_patch.serving.chat_compat:compat_needed",
        counters=("error_message_cause",),
        why="the front end answers `str(exception)` as a 400's message: an exception without "
            "one (a remote image that timed out: `TimeoutError()`; a chat template's "
            "`raise_exception('')`) gives a 400 with an empty message",
        how="an empty message is replaced by the exception being handled, named by its type, "
            "with what is known of it by its own kind (its chained cause's message, a chat "
            "template's failure, a time-out) or only that the server log has the traceback; "
            "other messages unchanged",
        vllm="0.6.3 (code checked against 0.6.3.post1 and CoreX 3.2.3); not applied where "
             "the chat row is not",
        upstream="none (later releases still answer `str(e)`)",
        removal="with `chat_request_compat`"),
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
        "reasoning_stream", WRAP_INSTANCE,
        SERVING_CHAT + ":OpenAIServingChat.chat_completion_stream_generator",
        "vllm_bi100_patch.serving.tool_stream:make_stream_wrapper",
        params="code:vllm_bi100_patch.serving.tool_stream:check_stream",
        when=_ON_063,
        counters=("reasoning_stream",),
        why="`reasoning_output`'s concern for streams: the thinking arrives in "
            "`delta.content` and the streaming tool parser reads it",
        how="for an app with a reasoning parser, each engine output is split as it comes (a "
            "tag cut between deltas held back until whole): the answer is what 0.6.3 streams "
            "and parses, the thinking goes out as `delta.reasoning_content` in the choice's "
            "next chunk (a `content: \"\"` it replaces; never in the role chunk), what is "
            "left before the usage chunk and `[DONE]`; guided requests not split. Runs in "
            "the wrapper `stream_finish_reason` installs (one wrapper, whichever of the "
            "three rows is enabled)",
        vllm=_REASONING_VLLM, upstream=_REASONING_UPSTREAM,
        removal="with `reasoning_flags`"),
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
