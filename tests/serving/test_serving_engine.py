"""The serving rows of issue 35 through vLLM 0.6.3's own code, on the official 0.6.3.post1 wheel
and on the CoreX 3.2.3 stand-in: its engines (engine_probe.py: ``LLMEngine``,
``AsyncLLMEngine``, ``LLM``, the ``Scheduler``, the multiprocessing client, ``run_batch``'s
model), its OpenAI server app with ``--enable-auto-tool-choice --tool-call-parser hermes``
(tool_stream_app.py), its guided decoding (guided_probe.py) and ``doctor``; the venvs have
what a server installing vLLM 0.6.3 today has: a ``pyairports`` without
``pyairports.airports`` (tools/vllm_env).

Every probe runs in its own interpreter, all started at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
from helpers.probes import HARNESS, TAG, clean_env, installed_vllm, reports

pytestmark = pytest.mark.real_vllm

REAL = os.path.join(HARNESS, "real")
INSTALLED = installed_vllm()
SHIM = {"VLLM_BI100_PATCH": "1"}
STOCK = {"VLLM_BI100_PATCH": "0"}
DISABLE = "VLLM_BI100_PATCH_DISABLE"
AIRPORTS = ('AIRPORT_LIST = [("Goroka", "Goroka", "Papua New Guinea", "GKA", "AYGA", "-6.08", '
            '"145.39", "5282", "10", "U", "Pacific/Port_Moresby", ""), ("Charles de Gaulle", '
            '"Paris", "France", "CDG", "LFPG", "49.01", "2.55", "392", "1", "E", '
            '"Europe/Paris", ""), ("Unnamed", "X", "Y", "", "ZZZZ", "0", "0", "0", "0", "U", '
            '"", "")]\n')


def _runs(tmp):
    real = os.path.join(tmp, "real-pyairports")
    os.makedirs(os.path.join(real, "pyairports"))
    open(os.path.join(real, "pyairports", "__init__.py"), "w").close()
    with open(os.path.join(real, "pyairports", "airports.py"), "w") as fh:
        fh.write(AIRPORTS)
    # each run builds its guides; a guide is built inside the async engine's loop step, which
    # vLLM aborts after VLLM_ENGINE_ITERATION_TIMEOUT_S (60 s; outlines' first build on 2 busy
    # cores can take longer; BI-V100 deployments run 3600, docs/corex-3.2.3.md)
    cache = {"OUTLINES_CACHE_DIR": os.path.join(tmp, "outlines"),
             "VLLM_ENGINE_ITERATION_TIMEOUT_S": "3600"}
    return {
        "engine": ("engine_probe.py", [], dict(SHIM, **cache)),
        "engine_stock": ("engine_probe.py", ["lora_hol", "run_batch", "mq_client",
                                             "llm_refused_batch", "engine_guided",
                                             "async_guided"], dict(STOCK, **cache)),
        # one row off each: the stand-in is not supplied, the client does not refuse
        "engine_rows_off": ("engine_probe.py", ["engine_guided", "async_guided", "mq_client"],
                            dict(SHIM, **cache, **{
                                DISABLE: "guided_decoding_imports,seq_limit_client"})),
        # the default front end without seq_limit_openai: its client refuses on its own
        "app": ("tool_stream_app.py", [], dict(SHIM, **{DISABLE: "seq_limit_openai"})),
        "app_stock": ("tool_stream_app.py", [], STOCK),
        # --disable-frontend-multiprocessing: the app around vLLM's AsyncLLMEngine
        "in_process": ("tool_stream_app.py", ["in_process"], dict(SHIM, **cache)),
        "in_process_stock": ("tool_stream_app.py", ["in_process"], dict(STOCK, **cache)),
        "late": ("tool_stream_app.py", ["late"], SHIM),  # reverted at start, applied later
        "enforce": ("guided_probe.py", ["enforce"], dict(SHIM, **cache)),
        "guides": ("guided_probe.py", ["guides"], dict(SHIM, OUTLINES_CACHE_DIR=os.path.join(
            tmp, "outlines-guides"))),
        "guides_real": ("guided_probe.py", ["guides"], dict(SHIM, PYTHONPATH=real,
                                                            OUTLINES_CACHE_DIR=os.path.join(
                                                                tmp, "outlines-real"))),
        "doctor": ("-m", ["vllm_bi100_patch", "doctor"], dict(SHIM, **cache)),
    }


@pytest.fixture(scope="module")
def runs():
    if not INSTALLED.startswith("0.6.3"):
        pytest.skip(f"the serving rows are for vLLM 0.6.3; this is {INSTALLED}")
    with tempfile.TemporaryDirectory(prefix="bi100-serving-engine-") as tmp:
        procs = {}
        for name, (script, argv, env) in _runs(tmp).items():
            cmd = [sys.executable, script, *argv] if script == "-m" else \
                [sys.executable, os.path.join(REAL, script), *argv]
            procs[name] = subprocess.Popen(cmd, env=clean_env(env), cwd=REAL, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out = Runs()
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=900)
            done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
            out[name + "_log"] = "\n".join(line for line in (stdout + stderr).splitlines()
                                           if not line.startswith(TAG))
            if name == "doctor":
                out[name] = stdout
                continue
            try:
                out[name] = {r.get("case", r.get("scenario")): r for r in reports(done)}
            except AssertionError as exc:  # the tests that read this run fail, saying why
                out.failed[name] = str(exc)
    return out


class Runs(dict):
    """The runs' reports by name; a run that failed fails the tests that read it."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: dict = {}

    def __missing__(self, name):
        raise AssertionError(f"probe run {name!r} failed: {self.failed.get(name, '?')}")


def test_async_engine_refuses_like_llm_engine(runs):
    """Defect 5: n=5 under max_num_seqs=4 through ``AsyncLLMEngine.generate``: refused, not
    an empty text with finish_reason "length"."""
    assert runs["engine"]["async_n_over"]["error"].startswith(
        "ValueError: request big: n=5 asks for 5 parallel sequences, but this server runs at "
        "most max_num_seqs=4"), runs["engine"]["async_n_over"]


def test_a_refused_llm_batch_leaves_nothing_queued(runs):
    """Defect 6: the requests of a refused ``LLM.generate`` batch never come back later."""
    for case in ("llm_refused_batch_n", "llm_refused_batch_empty"):
        got = runs["engine"][case]
        assert got["error"].startswith("ValueError"), got
        assert got["queued_after"] == 0 and got["next_call"] == ["three"], got
    stock = runs["engine_stock"]["llm_refused_batch_empty"]
    assert stock["queued_after"] == 2 and stock["next_call"] == ["one", "two", "three"]
    assert "withdrew the 2 request(s) of it already queued (0, 1)" in runs["engine_log"]


def test_the_whole_waiting_queue_is_checked(runs):
    """Defect 7: an unschedulable group behind a head waiting for a LoRA slot is ignored; the
    plain request behind it starts at the step it arrives."""
    got = runs["engine"]["lora_hol"]
    assert got["ignored"] == ["big"] and got["scheduled"]["plain"] == 1, got
    assert got["scheduled"]["lora2"] > 1 and got["waiting"] == []  # waits for its LoRA slot
    stock = runs["engine_stock"]["lora_hol"]
    assert "plain" not in stock["scheduled"] and stock["waiting"] == ["big", "plain"], stock


def test_each_front_end_row_is_its_own_kill_switch(runs):
    """Defect 8: the default front end's client refuses n over max_num_seqs by itself
    (seq_limit_openai off: still a 400); with seq_limit_client off it does not, and status
    says so, while seq_limit_openai stays applied."""
    app = runs["app"]
    for case in ("n5", "n5_stream"):
        assert app[case]["status"] == 400, app[case]
        assert "n=5 asks for 5 parallel sequences" in app[case]["error"], app[case]
    assert "seq_limit_openai" not in app["status"]["applied"]
    assert app["status"]["counts"]["seq_limit_client"] == 2
    assert runs["engine"]["mq_client"]["n5"].startswith("ValueError: request big: n=5")
    assert runs["engine"]["mq_client"]["n4"] == "no error"
    off = runs["engine_rows_off"]
    assert off["mq_client"]["n5"] == "no error"
    assert off["status"]["skipped"]["seq_limit_client"] == "disabled by " + DISABLE
    assert "seq_limit_openai" in off["status"]["applied"]
    assert runs["engine_stock"]["mq_client"]["n5"] == "no error"
    assert runs["app_stock"]["n5"]["status"] == 200


def test_run_batch_validates_with_the_replaced_class(runs):
    """Defect 4: ``run_batch``'s ``BatchRequestInput`` accepts ``max_completion_tokens``."""
    got = runs["engine"]["run_batch"]
    assert got["error"] == "no error" and got["max_tokens"] == 3, got
    assert "max_completion_tokens" in runs["engine_stock"]["run_batch"]["error"]
    models = runs["engine"]["status"]["class_bindings"]["ChatCompletionRequest"]["models"]
    assert models == ["vllm.entrypoints.openai.protocol.BatchRequestInput"]


def test_a_late_activation_replaces_the_class_wherever_bound(runs):
    """Defect 3: applied after ``api_server`` was imported, the class reaches the apps built
    from then on (endpoint annotations, other modules' names); the app built before is named
    in status, and revert puts every original back."""
    late = runs["late"]
    assert late["late_after"]["status"] == 200, late["late_after"]
    assert late["late_before"]["status"] == 400
    assert "max_completion_tokens" in late["late_before"]["error"]
    bound = late["late_status"]["class_bindings"]["ChatCompletionRequest"]
    assert "vllm.entrypoints.openai.api_server.create_chat_completion(request)" in \
        bound["annotations"]
    assert "vllm.entrypoints.openai.api_server.ChatCompletionRequest" in bound["globals"]
    assert bound["stale_routes"] == 1, bound
    assert "1 route(s) of a server app built before the shim replaced ChatCompletionRequest" \
        in runs["late_log"]
    revert = late["late_revert"]
    assert revert["replaced_was_original"] == {"api_server": False, "annotation": False}
    assert revert["restored"] == {"api_server": True, "annotation": True, "batch": True}
    assert revert["class_bindings"] == {}


def test_guided_decoding_works_as_installed(runs):
    """outlines imports through the shim's pyairports stand-in; a guide that cannot be built
    is a ValueError naming the cause, through ``LLMEngine.add_request`` and
    ``AsyncLLMEngine``, nothing queued, the engine loop alive."""
    eng = runs["engine"]["engine_guided"]
    assert eng["choice"] == "no error" and eng["choice_processors"] == ["RegexLogitsProcessor"]
    assert eng["bad_regex"].startswith(
        "GuidedDecodingUnavailable: guided decoding (regex, backend outlines) cannot be built "
        "on this server: Unsupported"), eng
    assert eng["bad_regex_unfinished"] == 0
    asy = runs["engine"]["async_guided"]
    assert asy["choice"].get("outputs") == [["aa", "length"]], asy
    assert asy["plain"].get("outputs") == [["aa", "length"]], asy
    assert asy["bad_regex"]["error"].startswith("GuidedDecodingUnavailable") and \
        asy["errored"] is False, asy
    imports = runs["engine"]["status"]["guided_imports"]
    assert imports["supplied"] == ["pyairports", "pyairports.airports"], imports
    assert runs["engine_log"].count("supplied an empty AIRPORT_LIST") == 1
    # the stand-in off: outlines cannot import; refused by name, the engine survives
    off = runs["engine_rows_off"]
    for got in (off["engine_guided"]["choice"], off["async_guided"]["choice"]["error"]):
        assert got.startswith("GuidedDecodingUnavailable: guided decoding (choice, backend "
                              "outlines) cannot be built on this server: ModuleNotFoundError: "
                              "No module named 'pyairports'"), got
        assert "guided_decoding_imports" in got and "#23983" in got
    assert off["async_guided"]["plain"]["outputs"] and off["async_guided"]["errored"] is False
    # stock, as a server installed today: the import error, and the async engine dies
    stock = runs["engine_stock"]
    assert stock["engine_guided"]["choice"] == "ModuleNotFoundError: No module named " \
                                               "'pyairports'"
    assert stock["async_guided"]["errored"] is True
    assert stock["async_guided"]["plain"]["error"].startswith("AsyncEngineDeadError")


def test_the_server_answers_an_unbuildable_guide_with_a_400_and_runs_on(runs):
    """0.6.3's own app around its ``AsyncLLMEngine`` (``--disable-frontend-multiprocessing``):
    a guide that cannot be built is a 400 naming the cause (an error event in a stream already
    answered), and the next requests are served; stock, the engine loop dies: 500s."""
    app = runs["in_process"]
    cause = ("guided decoding (regex, backend outlines) cannot be built on this server: "
             "Unsupported: lookbacks are not implemented")
    assert app["bad_guide"]["status"] == 400 and app["bad_guide"]["error"] == cause, app
    assert app["bad_guide_stream"]["error"][0]["message"] == cause
    for case in ("plain", "choice"):
        assert app[case]["status"] == 200 and app[case]["text"] == ["aa"], app[case]
    assert app["n5"]["status"] == 400 and "max_num_seqs=4" in app["n5"]["error"]
    stock = runs["in_process_stock"]
    assert {stock[c]["status"] for c in ("bad_guide", "plain", "choice", "n5")} == {500}, stock


def test_guided_decoding_enforces_schema_tool_and_required(runs):
    """0.6.3's own logits processors over random logits: every text parses and is valid
    under its schema (json_schema, a forced tool, required).  Issue 39: under required, tools
    whose schemas refer within themselves (a pointer, $defs below the top, an anchor) are
    nested with their references rewritten, outlines builds the guide and each call is valid
    under its own tool's schema; an empty json_schema and a named tool without parameters are
    guided as JSON objects (0.6.3 alone: free text); a recursive tool gets no outlines guide,
    named or required alike."""
    for case in ("json_schema", "named_tool", "required", "required_refs", "json_schema_empty",
                 "named_tool_no_parameters"):
        got = runs["enforce"][case]
        assert got["processor"] == "JSONLogitsProcessor", got
        assert got["valid"] == [True] * 5, got
    assert runs["enforce"]["named_tool"]["schema"]["properties"]["unit"] == {"enum": ["c", "f"]}
    required = runs["enforce"]["required"]["schema"]  # the shim's chat row made it
    assert required["type"] == "array" and required["minItems"] == 1, required
    assert '"get_weather"' in json.dumps(required) and '"get_time"' in json.dumps(required)
    refs = json.dumps(runs["enforce"]["required_refs"]["schema"])
    assert '"#/items/anyOf/1/properties/parameters/properties/x/$defs/In"' in refs, refs
    recursion = runs["enforce"]["recursion"]
    assert recursion["named"] == recursion["required"] == "RecursionError", recursion


def test_the_empty_airport_list_changes_no_guide(runs):
    """The finite-state machines of a JSON schema, a required-tools schema, a regex and a
    choice are the same with the shim's empty AIRPORT_LIST as with a real-shaped one; only
    outlines' airport-code enum differs."""
    empty, real = runs["guides"]["guides"], runs["guides_real"]["guides"]
    assert empty["guides"] == real["guides"]
    assert (empty["substitute"], empty["airport_list"], empty["iata"]) == (True, 0, 0)
    assert (real["substitute"], real["airport_list"], real["iata"]) == (False, 3, 2)


def test_streamed_hermes_tool_calls(runs):
    """The hermes parser's streaming defects: no AttributeError for a ``<tool_call>`` delta;
    every streamed choice ends with a finish_reason, ``length`` when cut."""
    app, stock = runs["app"], runs["app_stock"]
    call = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    for run in (app, stock):
        assert run["complete_stream"]["tool_calls"] == call
        assert run["complete_stream"]["finish"] == ["tool_calls"]
        assert run["complete"]["finish"] == "tool_calls"
    attr = "AttributeError: 'NoneType' object has no attribute 'get'"
    assert attr in runs["app_stock_log"] and attr not in runs["app_log"]
    assert app["status"]["counts"]["hermes_tool_start"] == 5  # one per streamed <tool_call>
    for case in ("cut_at_start", "cut_in_name"):
        got = app[case + "_stream"]
        assert got["finish"] == ["length"] and got["done"] and got["chunks"] == 3, got
        assert stock[case + "_stream"]["finish"] == [] and stock[case + "_stream"]["done"]
        assert app[case]["finish"] == "length"  # unstreamed: the text as content, as upstream
        assert app[case]["message"]["content"].startswith("<tool_call>")
    assert app["cut_in_arguments_stream"]["finish"] == ["length"]
    assert stock["cut_in_arguments_stream"]["finish"] == ["tool_calls"]
    usage = app["cut_in_name_usage"]
    assert usage["finish"] == ["length"] and None not in usage["usage"], usage
    assert usage["usage"][-2] == usage["usage"][-1]  # the finish chunk's, the final usage
    assert app["text_stream"]["content"] == "hello world" and app["text_stream"]["finish"] == [
        "stop"]


def test_the_final_usage_counts_every_choice(runs):
    """CoreX 3.2.3's serving_chat.py (vLLM 0.6.2's usage code) counts the last choice's tokens
    in a stream's final usage; 0.6.3.post1 sums every choice, and so does the shim on both."""
    app, stock = runs["app"], runs["app_stock"]
    for run in (app, stock):
        for n in (1, 2):
            got = run[f"n{n}_usage"]
            assert got["status"] == 200 and got["finish"] == ["stop"] * n, got
            assert sorted(got["content"]) == sorted("hello world" * n)  # interleaved
    one = app["n1_usage"]["usage"][-1]["completion_tokens"]
    assert one > 0 and app["n2_usage"]["usage"][-1]["completion_tokens"] == 2 * one
    vendor = "corex" in INSTALLED
    assert stock["n2_usage"]["usage"][-1]["completion_tokens"] == (one if vendor else 2 * one)
    assert app["status"]["counts"].get("stream_usage_summed", 0) == (1 if vendor else 0)


def test_doctor_says_which_guided_backend_works(runs):
    section = runs["doctor"].split("\nguided decoding\n")[1].split("\n", 8)
    text = "\n".join(section)
    assert "[WARN] pyairports: 0.0.1+vllmenv.impostor is not the delisted airport-data " \
           "package: it has no pyairports.airports (installs top-level sample)" in text, text
    assert "[ok  ] guided_decoding_imports: supplies pyairports.airports" in text, text
    assert "[ok  ] outlines: imports (with the shim's pyairports.airports)" in text, text
    assert "working here: outlines" in text, text
