"""Targets judged on the figure as printed: a value is rounded to the digits it is printed with
before it is compared, and it is printed with one digit more than its threshold has, so that
a printed figure and its verdict always agree (0.849 is printed as 0.849 and misses 0.85; it
is never printed as 0.85 beside a verdict of "missed", nor judged "met" from a rounding)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


def decimals(x: float) -> int:
    """The decimal places a threshold is written with (0.85 -> 2)."""
    text = repr(float(x))
    return len(text.split(".")[1].rstrip("0")) if "." in text else 0


@dataclass(frozen=True)
class Verdict:
    name: str
    printed: str  # the value as printed beside the verdict
    threshold: float
    higher_is_better: bool
    met: bool

    def line(self) -> str:
        op = ">=" if self.higher_is_better else "<"
        return f"{self.name} {self.printed} (target {op} {self.threshold:g}): {'met' if self.met else 'NOT met'}"

    def to_dict(self) -> dict:
        return asdict(self)


def judge(name: str, value: float, threshold: float, higher_is_better: bool = True) -> Verdict:
    """``value`` against ``threshold`` (``>=`` if higher is better, else ``<``), on the printed rounding."""
    digits = decimals(threshold) + 1
    shown = round(float(value), digits)
    met = shown >= threshold if higher_is_better else shown < threshold
    return Verdict(name, f"{shown:.{digits}f}", float(threshold), higher_is_better, met)
