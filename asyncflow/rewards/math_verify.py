"""Check a model's final math answer against a reference (GSM8K / DeepScaleR / MATH style).

Front end (ours): the answer is the last `\\boxed{...}` in the response, else the number
after a `####` marker, else the last number in the text. Both sides are normalised (dollar
signs, spaces, thousands commas, leading +, trailing .0, \\dfrac, percent signs, `x =`
prefixes).

Comparison, in order:
1. exact rationals, when both sides parse as plain numbers (0.5 == 1/2 == \\frac{1}{2}, and
   1/3 != 0.333333): a final verdict either way, no solver involved;
2. the normalised strings, when they are equal;
3. otherwise the `math-verify` library (Hugging Face; what verl, TRL and open-r1 use) parses
   both sides from LaTeX into sympy and checks symbolic equivalence: 2\\sqrt{2} == \\sqrt{8},
   (1,2] == \\left(1,2\\right], \\{1, 2\\} == 2, 1, \\frac{\\pi}{2} == \\pi/2.

`math_verify` (and sympy) are imported on the first call that reaches step 3.

Timeouts: math-verify bounds its parse and verify calls with `signal.alarm`, which works only
in the main thread (elsewhere it raises ValueError), and on its way out cancels whatever alarm
was pending (a pytest-timeout, a caller's own). So its timeouts are used only in the main
thread when no alarm is pending; otherwise they are off and the caller bounds the call:
`RewardRunner` runs rewards on worker threads under its own `timeout_s`.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from fractions import Fraction
from typing import Any

__all__ = ["extract_answer", "extract_boxed", "extract_final_number", "math_equal", "math_reward", "normalize",
           "symbolic_equal", "to_rational"]

# math-verify's own limits (whole seconds: signal.alarm), used where signals can be (module docstring).
PARSE_TIMEOUT_S = 5
VERIFY_TIMEOUT_S = 5

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_NUMBER_RE = re.compile(rf"(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac(\d)(\d)")  # \frac12
_PLAIN_INT_RE = re.compile(r"[-+]?[0-9]+", re.ASCII)  # what normalize leaves as it is, but a leading +


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces allowed; None if absent or unclosed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        # "\boxed 42": the token after a space
        m = re.match(r"\\(?:boxed|fbox)\s+(\S+)", text[start:])
        return m.group(1).rstrip(".$") if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_final_number(text: str) -> str | None:
    """The last number in the text (with sign, commas, decimals or a/b); None if none."""
    text = _FRAC_RE.sub(r"\1/\2", text.replace("−", "-"))
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str) -> str | None:
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        return extract_final_number(tail) or tail.strip() or None
    return extract_final_number(text)


def normalize(ans: str) -> str:
    """A canonical spelling of an answer, for comparing non-numeric answers too."""
    s = ans.strip().replace("−", "-")
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    for junk in ("\\$", "$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\%", "%", "^\\circ", "^{\\circ}", "°"):
        s = s.replace(junk, "")
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"^[a-zA-Z]=", "", s)  # "x=5" -> "5"
    s = _FRAC_SHORT_RE.sub(r"\1/\2", s)
    while True:  # innermost first, so nested fractions unwind
        new = _FRAC_RE.sub(r"(\1)/(\2)", s)
        if new == s:
            break
        s = new
    s = re.sub(r"(\d),(?=\d{3}(?!\d))", r"\1", s)  # 1,234,567 -> 1234567
    s = s.rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    s = re.sub(r"(\d)\.0+$", r"\1", s)  # 42.0 -> 42
    return s


def _plain_rational(s: str) -> Fraction | None:
    s = s.strip()
    while s.startswith("(") and s.endswith(")") and s.count("(") == 1:
        s = s[1:-1]
    if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", s):
        return None
    return Fraction(s)


def to_rational(ans: str) -> Fraction | None:
    """The exact value of a normalised integer, decimal or fraction (a/b, -(a)/(b)); None otherwise."""
    plain = ans.strip()
    if _PLAIN_INT_RE.fullmatch(plain):  # most answers of a numeric task: skip normalize's passes
        return Fraction(int(plain))
    s = normalize(ans)
    sign = 1
    if s.startswith("-") and "/" in s:
        sign, s = -1, s[1:]
    parts = s.split("/")
    if len(parts) == 1:
        return _plain_rational(s)
    if len(parts) == 2:
        num, den = _plain_rational(parts[0]), _plain_rational(parts[1])
        if num is not None and den:
            return sign * num / den
    return None


def _signal_timeouts_usable() -> bool:
    """True in the main thread when no SIGALRM timer is pending (math-verify would cancel it)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        return False
    return signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


_MATH_VERIFY: Any = None


def _drop_timeout_disabled_warning(record: logging.LogRecord) -> bool:
    """math-verify warns once that with its timeouts off the caller must bound the call; we do."""
    return not str(record.msg).startswith("Timeout is disabled")


def _math_verify() -> Any:
    """The math_verify module, imported on first use (it pulls in sympy and an ANTLR parser)."""
    global _MATH_VERIFY
    if _MATH_VERIFY is None:
        try:
            import math_verify  # the library, not this module: imports are absolute
        except ImportError as err:
            raise ImportError("the `math` reward needs the `math-verify` package (a requirement of "
                              "asyncflow): pip install -r requirements.txt") from err
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_drop_timeout_disabled_warning)
        _MATH_VERIFY = math_verify
    return _MATH_VERIFY


def symbolic_equal(pred: str, gold: str) -> bool:
    """math-verify's verdict on two extracted answers (each read as the content of a \\boxed{})."""
    if not pred.strip() or not gold.strip():
        return False
    mv = _math_verify()
    timed = _signal_timeouts_usable()
    parse_timeout = PARSE_TIMEOUT_S if timed else None
    gold_parsed = mv.parse("\\boxed{" + gold + "}", parsing_timeout=parse_timeout)
    pred_parsed = mv.parse("\\boxed{" + pred + "}", parsing_timeout=parse_timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=VERIFY_TIMEOUT_S if timed else None))


def math_equal(pred: str, gold: str) -> bool:
    """pred equals gold: exactly as rationals when both are plain numbers, else as normalised
    strings, else symbolically (math-verify)."""
    p, g = to_rational(pred), to_rational(gold)
    if p is not None and g is not None:
        return p == g
    if normalize(pred) == normalize(gold) != "":
        return True
    return symbolic_equal(pred, gold)


def math_reward(response: str, answer: str, **_: object) -> float:
    """1.0 if the response's final answer equals the reference, else 0.0."""
    pred = extract_answer(response)
    if pred is None:
        return 0.0
    gold = extract_boxed(answer) if "\\boxed" in answer else answer
    return 1.0 if math_equal(pred, gold if gold is not None else answer) else 0.0
