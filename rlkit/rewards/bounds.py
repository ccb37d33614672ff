"""Bounds on an answer before any parser or sympy reads it: what a policy writes must not stall scoring.

Parsers and computer algebra are slow on some inputs (measured with math-verify 0.9 on 2 CPU cores: a
parenthesis nested 10 deep takes ~1 s to parse, 20 deep more than 10 s; ``(x+1)^{999}`` or a product of
200 binomials makes sympy expand for minutes; ``9^{{9}^{9}}`` asks for a 370-million-digit integer, in C,
past any Python-level time limit). :func:`AnswerBounds.violation` reads the text once, in time linear in
its length, with a loose parse of LaTeX and plain arithmetic that computes *upper bounds* (never values):
the magnitude of every number the expression would evaluate to, the exponent of every power of a symbolic
base, and how many terms a product or power of sums would expand to. Symbols (``x``, ``\\pi``) count as
magnitude 1; an operator it does not know separates two expressions; every number, power and factorial
is bounded whatever its spelling (``9^9^9``, ``9^{{9}^{9}}``, ``2**2**2**2``, ``9!!``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# a number (with an exponent: 1e5), a command, ** (a power), any other character
_TOKEN = re.compile(r"((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)|(\\[A-Za-z]+|\\.)|(\*\*)|(\S)")
_OPEN, _CLOSE = {"(", "[", "{", "\\{", "\\(", "\\["}, {")", "]", "}", "\\}", "\\)", "\\]"}
_SUM = {"+", "-", "\\pm", "\\mp"}
# set operations multiply too: sympy's unions of intervals grow like products (measured: 8 symbolic
# intervals take over 6 s)
_PRODUCT = {"*", "/", "\\cdot", "\\times", "\\div", "\\ast", "\\cup", "\\cap", "\\setminus"}
_FRACTION = {"\\frac", "\\dfrac", "\\tfrac", "\\cfrac", "\\binom", "\\dbinom", "\\tbinom"}
# spacing and sizing commands: nothing to read
_SKIP = {"\\left", "\\right", "\\big", "\\Big", "\\bigl", "\\bigr", "\\displaystyle", "\\limits"}
_SKIP |= {"\\,", "\\;", "\\:", "\\!", "\\ "}
# relations and list separators: they end an expression
_SEPARATORS = {"\\le", "\\leq", "\\ge", "\\geq", "\\ne", "\\neq", "\\approx", "\\equiv", "\\sim", "\\in"}
_SEPARATORS |= {"\\notin", "\\to", "\\implies", "\\iff", "\\quad", "\\qquad"}
_SEPARATORS |= {"\\\\", "\\mid", "\\colon", "\\text", "\\textbf", "\\mathrm", "\\mbox", "\\operatorname"}
_NOT_ATOMS = _CLOSE | _SUM | _PRODUCT | _SEPARATORS
_LOG2 = math.log10(2)


class OutOfBounds(Exception):
    """The text holds something beyond the bounds; the message says what."""


@dataclass(frozen=True)
class _Size:
    """Upper bounds of one sub-expression: ``log`` of the magnitude of its numbers (log10, >= 0),
    ``terms`` once expanded; ``numeric`` when it holds no symbol (sympy then evaluates it exactly)."""

    log: float = 0.0
    terms: float = 1.0
    numeric: bool = True


_SYMBOL = _Size(numeric=False)


@dataclass(frozen=True)
class AnswerBounds:
    """What an answer may hold to be read at all (larger ones are scored 0 unread).

    Args:
        max_chars: the longest answer text, in characters.
        max_depth: the deepest nesting of brackets (``{``, ``(``, ``[``) and of commands such as ``\\frac``.
        max_digits: the most digits of a number written, and of any number it evaluates to
            (``2^{4000}`` has 1,205).
        max_exponent: the largest exponent of a symbolic base (``x^{100}``; also the upper limit of a
            ``\\sum`` or ``\\prod``).
        max_terms: the most terms a product or power of sums expands to (``(x+y+z)^{8}``: 45).
        max_items: the most items of one list, set, tuple or sum as written (``\\{1, 2, 3\\}``: 3).
    """

    max_chars: int = 500
    max_depth: int = 6
    max_digits: int = 1000
    max_exponent: int = 100
    max_terms: int = 50
    max_items: int = 16

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_depth", "max_digits", "max_exponent", "max_terms", "max_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"AnswerBounds: {name} must be >= 1, got {getattr(self, name)}.")

    def violation(self, text: str, prose: bool = False) -> str | None:
        """What in ``text`` is beyond the bounds (e.g. "a power of about 10^8 digits"), or None.

        ``text`` is one answer (its items, separated by commas, count together), or with ``prose`` the
        end of a solution: its fragments between separators are read one by one, and each ``$...$``
        (or ``\\(...\\)``) as one answer.
        """
        if len(text) > self.max_chars:
            return f"{len(text)} characters, more than {self.max_chars}"
        try:
            _Reader(self, [m.group(0) for m in _TOKEN.finditer(text)]).sequence(until=None, count=not prose)
        except OutOfBounds as error:
            return str(error)
        return None


class _Reader:
    """A recursive-descent reading of a token list that only computes ``_Size`` bounds (each token once)."""

    def __init__(self, bounds: AnswerBounds, tokens: list[str]) -> None:
        self.bounds, self.tokens, self.i = bounds, tokens, 0
        self.depth = 0  # brackets and exponents open here (a tower is as deep as it is high)
        self.level = 0  # every construct open here, commands included (\sqrt\sqrt\sqrt...): bounds the recursion

    def peek(self) -> str | None:
        while self.i < len(self.tokens) and self.tokens[self.i] in _SKIP:
            self.i += 1
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        self.i += 1
        return token

    def enter(self, bracket: bool) -> None:
        self.depth += bracket
        self.level += 1
        if self.depth > self.bounds.max_depth or self.level > 4 * self.bounds.max_depth:
            raise OutOfBounds(f"nesting deeper than {self.bounds.max_depth}")

    def leave(self, bracket: bool) -> None:
        self.depth -= bracket
        self.level -= 1

    def sequence(self, until: str | None, count: bool = True) -> _Size:
        """Expressions separated by anything that is no operator (``,``, ``=``, punctuation), up to ``until``
        (``")"``: any closing bracket; ``"$"``; None: the end), consumed. Sized as their sum and, with
        ``count``, at most ``max_items`` of them; without, each is bounded alone (the fragments of prose)."""
        total, items = None, 0
        while (token := self.peek()) is not None:
            if token in _CLOSE or token == "$" and until == "$":
                self.i += 1
                if until is not None:
                    break
                continue  # an unmatched closing bracket
            if token == "$" and until is None and not count:  # prose: $...$ is one answer
                self.i += 1
                self.enter(bracket=True)
                self.sequence(until="$")
                self.leave(bracket=True)
            elif self._starts_atom(token) or token in _SUM:
                size = self.expression()
                items += 1
                if count and items > self.bounds.max_items:
                    raise OutOfBounds(f"more than {self.bounds.max_items} items in one list or sum")
                total = size if total is None or not count else self._add(total, size)
            else:
                self.i += 1  # a separator
        return total or _Size()

    def _starts_atom(self, token: str) -> bool:
        """A number, a letter or word, a command (``\\pi``, ``\\frac``) or an opening bracket."""
        if token in _NOT_ATOMS:
            return False
        return token in _OPEN or _is_number(token) or token[0] == "\\" or token.isalpha()

    def expression(self) -> _Size:
        size, summands = self.term(), 1
        while self.peek() in _SUM:
            self.i += 1
            size, summands = self._add(size, self.term()), summands + 1
            if summands > self.bounds.max_items:
                raise OutOfBounds(f"more than {self.bounds.max_items} items in one list or sum")
        return size

    def term(self) -> _Size:
        size = None
        while (token := self.peek()) is not None:
            if token in _PRODUCT:
                self.i += 1
                continue
            if token in _SUM and size is None:  # a sign
                self.i += 1
                continue
            if not self._starts_atom(token):
                break
            factor = self.power()
            size = factor if size is None else self._multiply(size, factor)
        return size or _Size()

    def power(self) -> _Size:
        """An atom with its postfixes: ``^`` exponents (right-associative), ``!``, ``_`` subscripts, ``'``."""
        base = self.atom()
        while (token := self.peek()) in ("!", "_", "'"):
            self.i += 1
            if token == "!":
                base = self._factorial(base)
            elif token == "_":
                self.atom()  # a subscript names, it does not compute (x_{1}); still read, and bounded
        if self.peek() in ("^", "**"):
            self.i += 1
            while self.peek() in _SUM:  # a signed exponent: 2^{-3}, 2^-3
                self.i += 1
            self.enter(bracket=True)
            exponent = self.power()
            self.leave(bracket=True)
            base = self._raise(base, exponent)
            while self.peek() == "!":
                self.i += 1
                base = self._factorial(base)
        return base

    def atom(self) -> _Size:
        token = self.take()
        if token is None or token in _CLOSE:
            return _Size()
        if token in _OPEN:
            self.enter(bracket=True)
            size = self.sequence(until=")")
            self.leave(bracket=True)
            return size
        if _is_number(token):
            return self._number(token)
        if token in _FRACTION:
            self.enter(bracket=False)
            top, bottom = self.power(), self.power()
            self.leave(bracket=False)
            if token.endswith("binom"):
                return self._binomial(top, bottom)
            return _Size(top.log + bottom.log, top.terms * bottom.terms, top.numeric and bottom.numeric)
        if token == "\\sqrt":
            self.enter(bracket=False)
            if self.peek() == "[":
                self.atom()  # the root's degree
            radicand = self.power()
            self.leave(bracket=False)
            return _Size(radicand.log / 2, radicand.terms, radicand.numeric)
        return _SYMBOL  # a letter, a word, a symbol command (\pi, \infty) or a function name (\sin)

    # ---- the bounds ----

    def _number(self, token: str) -> _Size:
        mantissa, _, exponent = token.lower().partition("e")
        digits = sum(c.isdigit() for c in mantissa)
        if digits > self.bounds.max_digits:
            raise OutOfBounds(f"a number of {digits} digits, more than {self.bounds.max_digits}")
        whole = mantissa.split(".")[0].lstrip("0")
        log = len(whole) if len(whole) >= 300 else math.log10(max(1.0, float(mantissa)))
        if exponent:  # 1e400 (as sympy reads it): exact, so as many digits
            log += abs(int(exponent)) if len(exponent.lstrip("+-")) < 10 else math.inf
        return _Size(log=self._digits(log, "a number"))

    def _value(self, size: _Size) -> float:
        """The largest absolute value a numeric size allows (inf beyond what a float holds)."""
        return 10.0**size.log if size.log < 300 else math.inf

    def _digits(self, log: float, what: str) -> float:
        if log > self.bounds.max_digits:
            raise OutOfBounds(f"{what} of {_count(log)} digits, more than {self.bounds.max_digits}")
        return log

    def _add(self, a: _Size, b: _Size) -> _Size:
        high, low = max(a.log, b.log), min(a.log, b.log)
        log = high + math.log10(1 + 10.0 ** (low - high))
        return _Size(log, self._terms(a.terms + b.terms), a.numeric and b.numeric)

    def _multiply(self, a: _Size, b: _Size) -> _Size:
        log = self._digits(a.log + b.log, "a product")
        return _Size(log, self._terms(a.terms * b.terms), a.numeric and b.numeric)

    def _terms(self, terms: float) -> float:
        if terms > self.bounds.max_terms:
            raise OutOfBounds(f"an expansion into more than {self.bounds.max_terms} terms")
        return terms

    def _raise(self, base: _Size, exponent: _Size) -> _Size:
        if not exponent.numeric:  # x^n, 2^x: sympy keeps it as it is
            return _Size(base.log, 1.0, False)
        power = self._value(exponent)
        if base.numeric:
            return _Size(self._digits(power * base.log, "a power"), 1.0, True)
        if power > self.bounds.max_exponent:
            raise OutOfBounds(
                f"a power of a symbol with an exponent up to {_value(exponent.log)}, above {self.bounds.max_exponent}"
            )
        n, k = (
            math.ceil(power - 1e-9),
            base.terms,
        )  # 10**log10(49) is 49.000000000000014  # (a_1 + ... + a_k)^n has at most C(n + k - 1, k - 1) terms
        terms = round(math.exp(math.lgamma(n + k) - math.lgamma(n + 1) - math.lgamma(k))) if k > 1 else 1.0
        return _Size(self._digits(power * base.log, "a power"), self._terms(terms), False)

    def _factorial(self, size: _Size) -> _Size:
        if not size.numeric:
            return _Size(size.log, size.terms, False)
        n = self._value(size)
        if n > 1e7:
            raise OutOfBounds(f"a factorial of a number up to {_value(size.log)}")
        return _Size(self._digits(math.lgamma(n + 1) / math.log(10), "a factorial"), 1.0, True)

    def _binomial(self, top: _Size, bottom: _Size) -> _Size:
        if not (top.numeric and bottom.numeric):
            return _Size(top.log, 1.0, False)
        n, k = self._value(top), self._value(bottom)
        if n > 1e7:
            raise OutOfBounds(f"a binomial coefficient of a number up to {_value(top.log)}")
        log = min(n * _LOG2, k * math.log10(max(n, 1.0)))  # C(n, k) <= 2^n and <= n^k
        return _Size(self._digits(log, "a binomial coefficient"), 1.0, True)


def _is_number(token: str) -> bool:
    return token[0].isdigit() or (token[0] == "." and len(token) > 1)  # a lone "." separates


def _count(x: float) -> str:
    """``1,205``; ``about 10^8`` from a million on; ``more than 10^300`` beyond a float."""
    if x < 1e6:
        return f"{x:,.0f}"
    return f"about 10^{int(math.log10(x))}" if math.isfinite(x) else "more than 10^300"


def _value(log: float) -> str:
    """The number whose log10 is ``log``, as :func:`_count` writes it."""
    return _count(10.0**log) if log < 300 else "more than 10^300"
