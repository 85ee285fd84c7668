"""vLLM 0.6.3's own OpenAI app (serving_app.py's ``serve``: ``make_arg_parser``, ``build_app``,
``init_app_state`` around the engine stand-in, ``--enable-auto-tool-choice --tool-call-parser
hermes``) for tests/serving/test_hostile_bodies.py, with a socket guard: every outbound
connection, name lookup or URL opening this server process attempts is recorded and refused
(``OSError``).  The server makes none of its own; the test's client connects from the test
process.

``python hostile_app.py``: reports ``{"case": "ready", "port": ...}``, serves until stdin
closes, then reports ``{"case": "guard", "attempts": [...]}``.

The engine stand-in calls tool ``slow_pattern`` with ``{"s": "aaa...a!"}`` (``SLOW_ARGS``):
against ``"pattern": "^(a|a)*$"`` Python's ``re`` backtracks for minutes.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package
sys.path.insert(0, HERE)

from helpers.probes import report  # noqa: E402

SLOW_ARGS = {"s": "a" * 40 + "!"}
ATTEMPTS: list = []
_lock = threading.Lock()


def _refuse(kind: str, what: object) -> None:
    with _lock:
        ATTEMPTS.append(f"{kind} {what!r}"[:300])
    raise OSError(f"blocked by the test's socket guard: {kind} {what!r}")


def install_guard() -> None:
    real_getaddrinfo = socket.getaddrinfo

    def connect(self, address):  # noqa: ANN001
        _refuse("connect", address)

    def connect_ex(self, address):  # noqa: ANN001
        _refuse("connect_ex", address)

    def create_connection(address, *a, **k):  # noqa: ANN001
        _refuse("create_connection", address)

    def getaddrinfo(host, *a, **k):  # noqa: ANN001
        if host in (None, "127.0.0.1", "localhost", "0.0.0.0", "::1", ""):
            return real_getaddrinfo(host, *a, **k)  # uvicorn binds; nothing leaves
        _refuse("getaddrinfo", host)

    def urlopen(url, *a, **k):  # noqa: ANN001
        _refuse("urlopen", getattr(url, "full_url", url))

    def opener_open(self, url, *a, **k):  # noqa: ANN001
        _refuse("OpenerDirector.open", getattr(url, "full_url", url))

    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
    socket.create_connection = create_connection  # type: ignore[assignment]
    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]
    urllib.request.urlopen = urlopen  # type: ignore[assignment]
    urllib.request.OpenerDirector.open = opener_open  # type: ignore[method-assign]


def guided_answer(original):
    """The stand-in's ``answer`` behind outlines' own schema translation: a guided request's
    schema goes through ``build_regex_from_schema`` of vLLM 0.6.3's outlines (its reference
    resolution included, under the guard) as the engine would build its guide; what outlines
    cannot translate is refused as row ``guided_decoding_errors`` refuses a guide that cannot
    be built (a ``ValueError``: a 400).  The FSM compilation is left out (seconds per schema)."""
    def answer(prompt, guided_json):
        if guided_json is not None:
            import json

            from outlines.fsm.json_schema import build_regex_from_schema

            text = guided_json if isinstance(guided_json, str) else json.dumps(guided_json)
            try:
                build_regex_from_schema(text)
            except Exception as exc:
                raise ValueError(f"guided decoding cannot be built: {type(exc).__name__}"
                                 ) from None
            try:
                return original(prompt, guided_json)
            except Exception:  # the stand-in's instance generator knows fewer schemas
                return ["{}"]
        return original(prompt, guided_json)
    return answer


def main() -> None:
    import serving_app
    import standin_answers

    standin_answers.ARGS["slow_pattern"] = SLOW_ARGS
    serving_app.answer = guided_answer(serving_app.answer)
    # The engine imports outlines for its first guided request, in its own process; the
    # stand-in translates on the app's loop, so it imports it before serving (seconds).
    import outlines.fsm.json_schema  # noqa: F401
    engine, server, thread, port = serving_app.serve()
    install_guard()
    report(case="ready", port=port)
    try:
        sys.stdin.read()  # until the test closes it
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        report(case="guard", attempts=list(ATTEMPTS))


if __name__ == "__main__":
    main()
