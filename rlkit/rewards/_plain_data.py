"""Plain data across the sandbox's process boundary: what a solution's process and its grader exchange.

Part of the programs that run inside the sandbox (``sandbox.py`` joins the files into one ``python -c``
text), so standard library only and no imports from rlkit. A message is one JSON line. Numbers,
strings, booleans, None and lists cross as JSON; tuples, sets, frozensets, dicts (any plain keys) and
integers too long for JSON's text cross as one-key objects (``{"tuple": [...]}``). Encoding accepts
exactly these built-in types, not subclasses; decoding builds only built-in values. So the receiver
compares real numbers and strings, whatever the sender was: an object whose ``__eq__`` always answers
True cannot cross.
"""

import json
import os

MAX_MESSAGE_BYTES = 1 << 24  # one message (a call's arguments or its result); more fails the call
_BIG_INT_BITS = 12_000  # about 3,600 digits: below Python's 4,300-digit limit on int <-> str


def encode(value):
    """``value`` as JSON-ready data; TypeError when it is not plain data."""
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if value.bit_length() < _BIG_INT_BITS else {"int": hex(value)}
    if kind is float:
        return value
    if kind is list:
        return [encode(item) for item in value]
    if kind is tuple or kind is set or kind is frozenset:
        return {kind.__name__: [encode(item) for item in value]}
    if kind is dict:
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    raise TypeError(f"a {kind.__module__}.{kind.__qualname__} is not plain data")


def decode(data):
    """The value ``encode`` gave ``data`` for; ValueError for anything ``encode`` does not write."""
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(item) for item in data]
    if kind is dict and len(data) == 1:
        ((tag, items),) = data.items()
        if tag == "int" and type(items) is str:
            return int(items, 16)
        if type(items) is list:
            if tag == "tuple":
                return tuple(decode(item) for item in items)
            if tag == "set":
                return {decode(item) for item in items}
            if tag == "frozenset":
                return frozenset(decode(item) for item in items)
            if tag == "dict" and all(type(pair) is list and len(pair) == 2 for pair in items):
                return {decode(k): decode(v) for k, v in items}
    raise ValueError(f"not plain data: {json.dumps(data)[:200]}")


class Channel:
    """JSON lines over a pair of pipe ends: ``send`` a dict, ``receive`` the other side's next one."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.reader = os.fdopen(read_fd, "rb")
        self.write_fd = write_fd

    def send(self, message: dict) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        while data:
            data = data[os.write(self.write_fd, data) :]

    def receive(self) -> dict | None:
        """The next message; None when the other side closed its end (it ended); ValueError when the
        line is too long or not a JSON object."""
        line = self.reader.readline(MAX_MESSAGE_BYTES + 1)
        if not line:
            return None
        if len(line) > MAX_MESSAGE_BYTES or not line.endswith(b"\n"):
            raise ValueError(f"a message longer than {MAX_MESSAGE_BYTES} bytes")
        message = json.loads(line)
        if type(message) is not dict:
            raise ValueError("a message that is not a JSON object")
        return message
