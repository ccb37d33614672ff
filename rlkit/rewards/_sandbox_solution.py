"""The solution's side of a grade: run the solution's code, then answer the grader's calls.

Part of the programs that run inside the sandbox (``_sandbox_runner.py`` says how they are joined).
This process never holds the tests, the grader's code, the grader's verdict channel or anything the
caller keeps secret: whatever the solution does here (to builtins, modules, these functions, its exit
status, what it prints) changes only the answers it sends, and the grader judges those.

Protocol (JSON lines, ``Channel``): after the code ran, ``{"ready": [names of what it defined that
can be called]}`` (or ``{"error": ...}`` when it raised); then, for each request, a reply:
``{"name", "args", "kwargs"}`` calls a function; ``{"stdin": text}`` runs the whole program again with
that input and answers the text it printed. A reply is ``{"ok": plain data}``, ``{"not_plain": why}``
or ``{"error": [type name, message]}``.
"""

import builtins
import io
import os
import sys


def serve(payload, channel, report):
    os.close(report)  # only the grader reports a verdict
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        code = compile(payload["solution"], "solution.py", "exec")
        if payload["mode"] == "call":
            exec(code, namespace)
    except BaseException as error:  # SystemExit too: a solution that exits has answered nothing
        import traceback

        traceback.print_exc()
        channel.send({"error": _describe(error)})
        return 1
    names = [name for name, value in namespace.items() if type(name) is str and callable(value)]
    channel.send({"ready": names if payload["mode"] == "call" else []})
    while (request := channel.receive()) is not None:
        try:
            if "stdin" in request:
                result = _run_program(code, request["stdin"])
            else:
                args, kwargs = decode(request["args"]), decode(request["kwargs"])  # noqa: F821 (_plain_data.py)
                result = namespace[request["name"]](*args, **kwargs)
        except BaseException as error:
            channel.send({"error": _describe(error)})
            continue
        try:
            channel.send({"ok": encode(result)})  # noqa: F821 (_plain_data.py)
        except (TypeError, ValueError, RecursionError) as error:
            channel.send({"not_plain": str(error)})
    return 0


def _run_program(code, text):
    """What the program prints to stdout when it reads ``text`` from stdin (``sys.exit(0)`` ends it normally)."""
    stdin = io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8")
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    saved = sys.stdin, sys.stdout
    sys.stdin, sys.stdout = stdin, stdout
    try:
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    finally:
        sys.stdin, sys.stdout = saved
    stdout.flush()
    return stdout.buffer.getvalue().decode("utf-8", "replace")


def _describe(error):
    try:
        return [type(error).__name__, str(error)[:1000]]
    except BaseException:
        return [type(error).__name__, ""]
