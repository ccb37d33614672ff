"""Answer-correctness rewards: exact strings and mathematical answers.

``MathAnswer`` follows the conventions of the MATH benchmark (Hendrycks et al. 2021: the answer is the
last ``\\boxed{...}``, compared after normalising LaTeX) and GSM8K (Cobbe et al. 2021: the answer
follows ``####``).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
import warnings
from fractions import Fraction
from typing import Any, Literal

from rlkit.data.boxed import last_boxed_span
from rlkit.data.prompts import Prompt
from rlkit.rewards.base import RewardFunction
from rlkit.rewards.bounds import AnswerBounds
from rlkit.rewards.calls import Rejected


def _require_ground_truth(reward: RewardFunction, prompt: Prompt) -> str:
    if prompt.ground_truth is None:
        raise ValueError(
            f"{type(reward).__name__} needs a ground truth, and this prompt has none: set "
            f"PromptFile's answer_key to the column holding the answers."
        )
    return prompt.ground_truth


class ExactAnswer(RewardFunction):
    """1.0 when the whole completion equals the ground truth after stripping whitespace, else 0.0.

    No answer extraction: for free-form answers use ``MathAnswer``.

    Args:
        name: the label of this reward's curve (``reward/<name>``).
    """

    def __init__(self, name: str = "accuracy") -> None:
        self.name = name

    def __call__(self, completion: str, prompt: Prompt) -> float:
        return float(completion.strip() == _require_ground_truth(self, prompt).strip())


_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: the last complete ``\\boxed{...}`` (nested braces allowed), else
    the rest of the line after the last ``####``, else the last number; None if there is none."""
    if (box := last_boxed_span(text)) is not None:
        return text[box[1] : box[2] - 1]
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
        if after:
            return after
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """A canonical string of a LaTeX answer, after Hendrycks et al. (2021)'s ``strip_string``.

    Removes ``\\left``/``\\right``, ``$``, thin spaces, ``\\text{}`` wrappers, degrees and ``%``, all
    whitespace and trailing periods; reads ``\\dfrac``/``\\tfrac`` as ``\\frac`` and ``\\frac12`` as
    ``\\frac{1}{2}``; drops a short left-hand side (``x=5`` → ``5``) and thousands separators of a
    number (``1,000`` → ``1000``). Units are not removed.
    """
    s = answer.strip()
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\[!,;: ]", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return s


_DECIMAL = r"-?(?:\d+(?:\.\d*)?|\.\d+)"


def _to_number(s: str) -> Fraction | None:
    """The exact value of a normalised number (``3``, ``-0.5``, ``1/2``, ``-\\frac{1}{2}``), else None."""
    if m := re.fullmatch(rf"(-?)\\frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}", s):
        sign, num, den = m.groups()
    elif m := re.fullmatch(rf"()({_DECIMAL})/({_DECIMAL})", s):
        sign, num, den = m.groups()
    elif re.fullmatch(_DECIMAL, s):
        return Fraction(s)
    else:
        return None
    if Fraction(den) == 0:
        return None
    return (-1 if sign else 1) * Fraction(num) / Fraction(den)


def _close(a: Any, b: Any, rel_tol: float) -> bool:
    """Equal within ``rel_tol``; an infinite value is close to nothing (1e400 evaluates to inf)."""
    if not all(math.isfinite(abs(x)) for x in (a, b)):
        return False
    return a == b or abs(a - b) <= rel_tol * max(abs(a), abs(b))


class MathAnswer(RewardFunction):
    """1.0 when the completion's final answer equals the ground truth, else 0.0.

    Two verifiers. ``math-verify`` (Hugging Face's ``math_verify``, ``pip install rlkit[math]``) finds
    the answer (``\\boxed{}``, ``$...$``, "the answer is", the last expression) and compares
    LaTeX and plain expressions symbolically, sets, intervals and tuples included. The built-in one
    takes the last ``\\boxed{...}`` (MATH, Hendrycks et al. 2021), else what follows ``####``
    (GSM8K, Cobbe et al. 2021), else the last number (see ``extract_answer``), normalises both
    (``normalize_answer``) and compares them as strings, as exact numbers (``0.5`` = ``1/2``, within
    ``rel_tol``), then with sympy symbolically when installed. Either way a ground truth holding a
    ``\\boxed{}`` or ``####`` is reduced to its answer first.

    What either verifier reads is bounded first (``bounds``, see ``rlkit.rewards.bounds``): the answer
    (math-verify: the last ``\\boxed{}``, else the completion's last ``bounds.max_chars`` characters)
    may not be too long, nested too deep, or hold a number, power, factorial or expansion too large to
    compute (``9^{9^{9}}``, ``(x+1)^{999}``, a 100,000-digit number). Such a completion scores 0 unread
    (``Rejected``, counted in ``reward/rejected``), so no completion can run into the scorer's time
    limit. A ground truth beyond the bounds is an error naming it (``check_ground_truth``, called on the
    data before the first rollout). math-verify's own time limits use ``SIGALRM``, which fails off the
    main thread; rlkit turns them off and relies on ``RewardScorer``'s per-call timeout instead.

    Args:
        name: the label of this reward's curve (``reward/<name>``).
        verifier: ``"math-verify"``, ``"builtin"``, or ``"auto"``: math-verify when installed, else
            built-in. Pin it so that runs on different machines score alike.
        use_sympy: built-in verifier only: compare symbolically with sympy. None uses it when installed.
        rel_tol: built-in verifier only: relative tolerance of numeric comparisons,
            ``|a - b| <= rel_tol * max(|a|, |b|)``; 0 demands exact equality.
        bounds: what an answer may hold to be read (length, nesting depth, digits, exponents, terms).
    """

    def __init__(
        self,
        name: str = "math",
        verifier: Literal["auto", "math-verify", "builtin"] = "auto",
        use_sympy: bool | None = None,
        rel_tol: float = 1e-9,
        bounds: AnswerBounds = AnswerBounds(),  # noqa: B008  (frozen: one shared default is safe)
    ) -> None:
        installed = importlib.util.find_spec("sympy") is not None
        if use_sympy and not installed:
            raise ValueError(
                "MathAnswer(use_sympy=True) needs sympy: `pip install rlkit[math]`, or set use_sympy "
                "to None or False for the string and number comparison."
            )
        if not 0.0 <= rel_tol < 1.0:
            raise ValueError(f"MathAnswer: rel_tol must be in [0, 1), got {rel_tol}; 1e-9 is typical.")
        has_math_verify = importlib.util.find_spec("math_verify") is not None
        if verifier not in ("auto", "math-verify", "builtin"):
            raise ValueError(f"MathAnswer: verifier must be 'auto', 'math-verify' or 'builtin', got {verifier!r}.")
        if verifier == "math-verify" and not has_math_verify:
            raise ValueError(
                "MathAnswer(verifier='math-verify') needs the math-verify package: `pip install rlkit[math]`, "
                "or set verifier to 'builtin'."
            )
        self.name = name
        self.verifier = ("math-verify" if has_math_verify else "builtin") if verifier == "auto" else verifier
        self.use_sympy = installed if use_sympy is None else use_sympy
        self.rel_tol = rel_tol
        self.bounds = bounds

    def check_ground_truth(self, value: str) -> str | None:
        """What makes ``value`` a ground truth this reward cannot read (beyond ``bounds``), or None."""
        reason = self.bounds.violation(_answer_of_truth(value))
        if reason is None:
            return None
        return (
            f"MathAnswer cannot read the ground truth {_shorten(value)!r}: {reason} (MathAnswer's bounds; "
            f"raise them with init_args: {{bounds: {{...}}}} if such answers are meant)"
        )

    def __call__(self, completion: str, prompt: Prompt) -> float:
        truth = _require_ground_truth(self, prompt)
        if (problem := self.check_ground_truth(truth)) is not None:
            raise ValueError(problem)  # the data's fault, not the completion's: data.prompts is checked first
        truth = _answer_of_truth(truth)
        if self.verifier == "math-verify":
            box = last_boxed_span(completion)
            if box is not None:
                shown, answer = completion[box[0] : box[2]], completion[box[1] : box[2] - 1]
            else:  # math-verify finds the answer in the end of the text ("the answer is $...$")
                shown = answer = _tail(completion, self.bounds.max_chars)
                if completion and not shown:
                    return Rejected(f"its last {self.bounds.max_chars} characters are one word or number")
            if (reason := self.bounds.violation(answer, prose=box is None)) is not None:
                return Rejected(reason)
            return _math_verify_equal(shown, truth)
        answer = extract_answer(completion)
        if answer is None:
            return 0.0
        if (reason := self.bounds.violation(answer)) is not None:
            return Rejected(reason)
        a, b = normalize_answer(answer), normalize_answer(truth)
        if a == b:
            return 1.0
        x, y = _to_number(a), _to_number(b)
        if x is not None and y is not None:
            return float(_close(x, y, self.rel_tol))
        return float(self.use_sympy and _sympy_equal(a, b, self.rel_tol))


def _answer_of_truth(truth: str) -> str:
    """A ground truth holding a ``\\boxed{}`` or ``####`` reduced to its answer."""
    if "\\boxed" in truth or "\\fbox" in truth or "####" in truth:
        return extract_answer(truth) or truth
    return truth


def _tail(text: str, size: int) -> str:
    """The last ``size`` characters of ``text``, less a word or number the cut falls in (the tail of
    "1000000" is not "0")."""
    start = max(0, len(text) - size)
    if start and text[start - 1].isalnum():
        while start < len(text) and text[start].isalnum():
            start += 1
    return text[start:]


def _shorten(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _math_verify_equal(completion: str, truth: str) -> float:
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # rlkit's RewardScorer times each call; without this the first call logs that math-verify's own
    # (SIGALRM) time limit is off.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    gold = _math_verify_gold(truth)
    config = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
    answer = math_verify.parse(completion, extraction_config=config, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return float(math_verify.verify(gold, answer, timeout_seconds=None))


@functools.lru_cache(maxsize=4096)
def _math_verify_gold(truth: str) -> list:
    """The parsed ground truth (cached: each is compared with ``G`` completions)."""
    import math_verify

    config = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
    return math_verify.parse(f"${truth}$", extraction_config=config, parsing_timeout=None)


# Only these names reach sympy's parser (its `parse_expr` evaluates Python): no builtins at all.
_SYMPY_NAMES = ("Integer", "Float", "Rational", "Symbol", "Mul", "Add", "Pow", "sqrt", "pi")


def _latex_to_sympy(s: str) -> str | None:
    """A normalised LaTeX answer as sympy input text, or None if it is more than arithmetic."""
    if len(s) > 200:
        return None
    previous = None
    while previous != s:  # innermost first, so nested fractions and roots unfold
        previous = s
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        s = re.sub(r"\\sqrt\[([^{}\[\]]*)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/").replace("\\pi", "pi")
    s = s.replace("^", "**").replace("{", "(").replace("}", ")")
    # Letters, digits, arithmetic and parentheses only: no quotes, brackets, underscores, attributes.
    if not re.fullmatch(r"[0-9A-Za-z+\-*/(). ]*", s) or re.search(r"\.[A-Za-z]", s):
        return None
    return s


def _sympy_equal(a: str, b: str, rel_tol: float) -> bool:
    """Symbolic equality of two normalised answers; False when either cannot be read."""
    import sympy
    from sympy.parsing.sympy_parser import auto_number, auto_symbol, implicit_multiplication, parse_expr
    from sympy.parsing.sympy_parser import rationalize as rationalize_floats

    names = {n: getattr(sympy, n) for n in _SYMPY_NAMES}
    transformations = (auto_symbol, auto_number, rationalize_floats, implicit_multiplication)
    exprs = []
    for text in (a, b):
        text = _latex_to_sympy(text)
        if text is None:
            return False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expr = parse_expr(
                    text,
                    local_dict={},
                    global_dict={**names, "__builtins__": {}},
                    transformations=transformations,
                    evaluate=False,
                )
        except Exception:  # any text sympy cannot parse is simply not an equal answer
            return False
        if not isinstance(expr, sympy.Expr) or not _bounded_powers(expr, sympy):
            return False
        exprs.append(expr)
    x, y = exprs
    try:
        if sympy.simplify(x - y) == 0:
            return True
        if x.free_symbols or y.free_symbols:
            return False
        u, v = complex(x.evalf()), complex(y.evalf())
        return _close(u, v, rel_tol)
    except Exception:  # e.g. division by zero, non-numeric evalf
        return False


def _bounded_powers(expr: Any, sympy: Any) -> bool:
    """False for numeric exponents above 1000 (``9^{9^9}`` would exhaust memory), innermost first."""
    for node in sympy.postorder_traversal(expr):
        if isinstance(node, sympy.Pow) and node.exp.is_number:
            value = node.exp.evalf(5)
            if not value.is_real or abs(value) > 1000:
                return False
    return True
