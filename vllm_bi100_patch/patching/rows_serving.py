"""The serving rows of the patch table (``table.PATCHES``): the V0 scheduler's queue and the
0.6.x OpenAI front end (``serving/seq_limit.py``, ``serving/chat_compat.py``,
``docs/serving-compat.md``).  Data only, read at interpreter start: stdlib only.
"""

from __future__ import annotations

from .patch_row import (LLM_ENGINE, MQ_CLIENT, PROTOCOL, REPLACE_CLASS, SCHEDULER, SERVING,
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
)
