"""Check a model's final math answer against a reference (GSM8K / DeepScaleR style).

The answer is the last `\\boxed{...}` in the response, else the number after a
`####` marker, else the last number in the text. Both sides are normalised (dollar
signs, spaces, thousands commas, leading +, trailing .0, \\dfrac, percent signs,
`x =` prefixes) and compared as exact rationals when both parse as numbers
(so 0.5 == 1/2 == \\frac{1}{2}), else as normalised strings.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["extract_answer", "extract_boxed", "extract_final_number", "math_equal", "math_reward", "normalize", "to_rational"]

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_NUMBER_RE = re.compile(rf"(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac(\d)(\d)")  # \frac12


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


def math_equal(pred: str, gold: str) -> bool:
    p, g = to_rational(pred), to_rational(gold)
    if p is not None and g is not None:
        return p == g
    return normalize(pred) == normalize(gold) != ""


def math_reward(response: str, answer: str, **_: object) -> float:
    """1.0 if the response's final answer equals the reference, else 0.0."""
    pred = extract_answer(response)
    if pred is None:
        return 0.0
    gold = extract_boxed(answer) if "\\boxed" in answer else answer
    return 1.0 if math_equal(pred, gold if gold is not None else answer) else 0.0
