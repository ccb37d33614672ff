"""The grader's side of a grade: run the tests in their own sandboxed process, calling the solution in its.

Part of the programs that run inside the sandbox (``_sandbox_runner.py`` says how they are joined).
The tests never leave this process, and the verdict leaves it only on ``report`` (the nonce the caller
gave in the payload, written when the tests ran to their end), which the solution's process does not
hold.

Python tests (``assert``s, or HumanEval's ``check(candidate)``): every name the solution's code
defined that can be called (except names of builtins) is a ``Candidate`` in the tests' namespace;
calling it sends the arguments to the solution's process and returns its result, decoded to built-in
values (``_plain_data.py``): a result that is not plain data, or a solution that does not answer,
raises ``SolutionError``; an exception in the solution raises the built-in exception of that name
(``ValueError``, ...) or ``SolutionError``. stdin/stdout cases: each input runs the whole program and
its output must equal the expected text, line by line, trailing white space and trailing empty lines
aside.
"""

import builtins
import os


class SolutionError(Exception):
    """The solution's call did not give a plain-data result."""


class Candidate:
    """A function of the solution, called across the process boundary."""

    def __init__(self, name, channel):
        self.__name__ = self.__qualname__ = name
        self._channel = channel

    def __call__(self, *args, **kwargs):
        request = {"name": self.__name__, "args": encode(args), "kwargs": encode(kwargs)}  # noqa: F821
        return _ask(self._channel, request)

    def __repr__(self):
        return f"<the solution's {self.__name__}>"


def _ask(channel, request):
    try:
        channel.send(request)
        reply = channel.receive()
    except (OSError, ValueError) as error:
        raise SolutionError(f"the solution's process did not answer ({error})") from None
    if reply is None:
        raise SolutionError("the solution's process ended")
    if "ok" in reply:
        try:
            return decode(reply["ok"])  # noqa: F821 (_plain_data.py)
        except (TypeError, ValueError, RecursionError) as error:
            raise SolutionError(f"the solution's result is not plain data ({error})") from None
    if "not_plain" in reply:
        raise SolutionError(f"the solution's result is not plain data ({reply['not_plain']})")
    error = reply.get("error")
    name, message = (error if type(error) is list and len(error) == 2 else ["?", ""])[:2]
    kind = getattr(builtins, name, None) if type(name) is str else None
    if isinstance(kind, type) and issubclass(kind, Exception):
        raise kind(f"in the solution: {message}")
    raise SolutionError(f"the solution raised {name}: {message}")


def serve(payload, channel, report):
    ready = channel.receive()
    names = ready.get("ready") if ready is not None else None
    if type(names) is not list:
        print(f"the solution did not run to its end: {ready}")
        return 1
    namespace = {"__name__": "__main__"}
    for name in names:
        if type(name) is str and name.isidentifier() and not name.startswith("__") and not hasattr(builtins, name):
            namespace[name] = Candidate(name, channel)
    if "tests" in payload:
        exec(compile(payload["tests"], "tests.py", "exec"), namespace)
    else:
        for number, (given, expected) in enumerate(payload["cases"]):
            output = _ask(channel, {"stdin": given})
            if type(output) is not str or _lines(output) != _lines(expected):
                got = repr(output)[:200]
                raise AssertionError(f"case {number}: for input {given[:200]!r} expected {expected[:200]!r}, got {got}")
    os.write(report, ("\n" + payload["nonce"] + "\n").encode())
    return 0


def _lines(text):
    return [line.rstrip() for line in text.rstrip().splitlines()]
