"""Today's OpenAI clients against vLLM 0.6.3's own server app, and a request the scheduler can
never run (serving_app.py, scheduler_probe.py): stock and with the shim, on the official
0.6.3.post1 wheel and on the CoreX 3.2.3 stand-in (the same protocol, chat and scheduler code).

All probes start at once (one server app per run, no model): a few seconds past vLLM's import.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real_vllm

ROWS = ("unschedulable_group", "seq_limit_engine", "seq_limit_client", "seq_limit_openai",
        "chat_request_compat", "completion_request_compat", "chat_tool_calls",
        "error_message_cause")


@pytest.fixture(scope="module")
def runs(serving_runs):
    """The session's two runs (conftest.py), under the names these tests read."""
    out = dict(serving_runs)
    # the scheduler's and the app's views of the same runs
    out["app_shim"] = out["sched_shim"] = out["shim"]
    out["app_stock"] = out["sched_off"] = out["stock"]
    out["app_shim_log"] = out["sched_shim_log"] = out["shim_log"]
    return out


def _applied(run):
    report = run["status"]["status"]["report"]
    return report["applied"], report


def test_every_row_applies_on_063(runs):
    applied, report = _applied(runs["shim"])
    assert report["reason"] is None, report
    assert set(ROWS) <= set(applied)
    assert runs["stock"]["status"]["status"] is None or \
        runs["stock"]["status"]["status"]["patched"] == []


def _ok(shim, stock, case):
    return shim[case]["status"], stock[case]["status"]


def test_fields_of_todays_clients_are_mapped_losslessly(runs):
    shim, stock = runs["app_shim"], runs["app_stock"]
    assert shim["plain"]["openai"] == "1.52.0"
    for case in ("max_completion_tokens", "ignored_fields", "message_extra_key",
                 "strict_false_named", "strict_true_named", "tool_choice_none",
                 "object_arguments", "top_logprobs_0", "developer_role"):
        assert shim[case]["status"] == 200, shim[case]
        assert stock[case]["status"] == 400 or case == "developer_role", stock[case]
        assert len(shim[case]["queued"]) == 1, shim[case]
    assert shim["max_completion_tokens"]["queued"][0]["max_tokens"] == 2
    assert shim["max_completion_tokens_wins"]["queued"][0]["max_tokens"] == 1  # as upstream
    assert "max_completion_tokens" in stock["max_completion_tokens"]["message"]
    # Ignored fields: nothing about the request changes; each named once in a WARNING.
    assert shim["ignored_fields"]["queued"] == shim["plain"]["queued"]
    log = runs["app_shim_log"]
    for field in ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                  "prediction", "modalities", "prompt_cache_retention", "prompt_cache_options",
                  "stream_options.include_obfuscation"):
        assert log.count(f"chat requests' field `{field}` accepted and ignored") == 1, \
            (field, log[-3000:])
    assert log.count("message key `reasoning_content` accepted and ignored") == 1
    assert "reasoning_content" in stock["message_extra_key"]["message"]
    # A strict tool named in tool_choice is enforced: its parameters are the guided schema.
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    assert shim["strict_true_named"]["queued"][0]["guided_json"] == params
    assert "strict" in stock["strict_false_named"]["message"]
    # tool_choice "none": the tools are dropped, as vLLM 0.6.4 does.
    assert shim["tool_choice_none"]["queued"][0]["prompt"] == "<|user|>hi<|assistant|>"
    assert "none" in stock["tool_choice_none"]["message"]
    # Object arguments reach the template as the arguments the string form gives.
    assert shim["object_arguments"]["queued"] == shim["string_arguments"]["queued"]
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in \
        shim["object_arguments"]["queued"][0]["prompt"]
    assert stock["string_arguments"]["status"] == 200
    assert shim["top_logprobs_0"]["queued"][0]["logprobs"] is None
    assert shim["developer_role"]["queued"][0]["prompt"].startswith("<|system|>be brief")
    assert stock["developer_role"]["queued"][0]["prompt"].startswith("<|developer|>be brief")


def test_json_schema_reaches_guided_decoding(runs):
    shim, stock = runs["app_shim"], runs["app_stock"]
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"]}
    assert _ok(shim, stock, "json_schema") == (200, 200)
    assert stock["json_schema"]["queued"][0]["guided_json"] is None  # silently unconstrained
    assert shim["json_schema"]["queued"][0]["guided_json"] == schema


def test_stream_usage_only_on_the_final_chunk_unless_asked(runs):
    shim, stock = runs["app_shim"], runs["app_stock"]
    every = stock["stream_usage"]["chunk_usage"]
    assert len(every) >= 3 and all(u is not None for u in every)
    final = shim["stream_usage"]["chunk_usage"]
    assert final[-1] == every[-1] and all(u is None for u in final[:-1]), final
    assert all(u is not None for u in shim["stream_usage_continuous"]["chunk_usage"])
    assert shim["stream_usage"]["text"] == stock["stream_usage"]["text"] == "hello world again"


def test_every_refusal_is_a_400_that_names_its_cause(runs):
    shim, stock = runs["app_shim"], runs["app_stock"]
    expect = {
        "reasoning_effort": "`reasoning_effort` is not supported by this server",
        "unknown_field": "frobnicate",
        "strict_one": "`tools[0].function.strict` must be true or false, not 1",
        "invalid_arguments": "messages[1].tool_calls[0].function.arguments is not valid JSON",
        "empty_messages": "`messages` is empty",
        "n_over_max_num_seqs": "n=2 asks for 2 parallel sequences, but this server runs at "
                               "most max_num_seqs=1",
        "best_of_over_max_num_seqs": "best_of=2 asks for 2 parallel sequences",
        "stream_n_over_max_num_seqs": "max_num_seqs=1",
        "completion_n_over_max_num_seqs": "n=2 asks for 2 parallel sequences",
    }
    for case, text in expect.items():
        assert shim[case]["status"] == 400, shim[case]
        assert text in shim[case]["message"], (case, shim[case]["message"])
        assert shim[case]["queued"] == [], shim[case]  # refused before anything is queued
    # An error without a message: stock answers an empty 400, the shim names the exception.
    assert stock["error_without_message"]["status"] == 400
    assert stock["error_without_message"]["message"] == ""
    assert shim["error_without_message"]["status"] == 400
    assert shim["error_without_message"]["message"].startswith(
        "TemplateError (raised without a message; the chat template failed on this request"), \
        shim["error_without_message"]  # its own kind, not a remote image's time-out
    assert "image" not in shim["error_without_message"]["message"]
    assert "unknown_field" in stock and "frobnicate" in stock["unknown_field"]["message"]
    # Stock queues what its scheduler can never run (and answers a stream with 200).
    assert stock["n_over_max_num_seqs"]["queued"][0]["n"] == 2
    assert stock["stream_n_over_max_num_seqs"]["status"] == 200
    assert stock["completion_n_over_max_num_seqs"]["queued"][0]["n"] == 2


def test_the_scheduler_never_blocks_its_queue(runs):
    on, off = runs["sched_shim"], runs["sched_off"]
    for scenario in ("n2_max1", "n2_max1_chunked", "best_of2_max1", "best_of2_max1_chunked",
                     "n257_max256", "n257_max256_chunked"):
        assert on[scenario]["ignored"] == ["big"], on[scenario]
        assert on[scenario]["scheduled"] == {"plain": 0}, on[scenario]
        assert on[scenario]["big_status"] == ["FINISHED_IGNORED"]
        # Stock, the request and everyone behind it wait forever (50 steps).
        assert off[scenario]["scheduled"] == {} and off[scenario]["ignored"] == []
        assert off[scenario]["waiting"] == ["big", "plain"], off[scenario]
    assert runs["sched_shim_log"].count("exceeds max_num_seqs=1: ignored") == 4


def test_add_request_refuses_before_queueing(runs):
    on, off = runs["sched_shim"], runs["sched_off"]
    assert on["add_request_n2_max1"]["error"] == (
        "ValueError: request req-1: n=2 asks for 2 parallel sequences, but this server runs "
        "at most max_num_seqs=1 sequences at once (--max-num-seqs): the request could never "
        "be scheduled; send n and best_of of at most 1")
    assert "n=1 and best_of=2" in on["add_request_best_of2_max1"]["error"]
    # Stock, vLLM's own method runs (and fails on what this stand-in lacks).
    assert off["add_request_n2_max1"]["error"].startswith("AttributeError"), off


def test_the_front_end_reads_the_limit_of_its_engine_client(runs):
    assert runs["shim"]["client_limit"]["recorded"] == 7
    assert runs["shim"]["client_limit"]["error"].startswith(
        "ValueError: request r1: n=8 asks for 8 parallel sequences, but this server runs at "
        "most max_num_seqs=7"), runs["shim"]["client_limit"]
    assert runs["stock"]["client_limit"] == {"scenario": "client_limit", "recorded": None,
                                             "error": "no error"}


def test_doctor_has_a_line_per_row(runs):
    doctor = runs["shim"]["status"]["doctor"]
    for attr in ("_schedule_prefills", "add_request", "__init__", "_check_model",
                 "ChatCompletionRequest", "CompletionRequest", "create_chat_completion",
                 "create_error_response"):
        lines = [ln for ln in doctor if f"] code check {attr}: " in ln]
        assert lines and all(ln.startswith("  [ok  ]") for ln in lines), (attr, doctor)
    assert not [ln for ln in doctor if "FAIL" in ln], doctor
