"""Math answer checking on handmade GSM8K / DeepScaleR / MATH-style responses: our extraction
front end, the exact-rational fast path, and math-verify's symbolic equivalence behind them."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

import pytest

from asyncflow.rewards import (
    RewardRunner,
    extract_answer,
    extract_boxed,
    get_reward,
    math_equal,
    math_reward,
    normalize,
)
from asyncflow.rewards import math_verify as mv_mod
from asyncflow.rewards.math_verify import extract_final_number, symbolic_equal, to_rational

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text,expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{2}", "2"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\sqrt{\frac{a}{b}}} done", r"\sqrt{\frac{a}{b}}"),
    (r"\boxed{{x}^{2}+1}", r"{x}^{2}+1"),
    (r"\fbox{7}", "7"),
    (r"\boxed 5.", "5"),
    (r"\boxed{3", None),
    ("no box", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("She has 3 apples and buys 4, total 7.", "7"),
    ("It costs $1,234.50 in all", "1,234.50"),
    ("answer: -12", "-12"),
    (r"the ratio is \frac{3}{4}", "3/4"),
    ("half is 1/2.", "1/2"),
    ("nothing here", None),
])
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    (r"#### 5 but \boxed{6}", "6"),
    ("#### 1,000", "1,000"),
])
def test_extract_answer_priorities(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("raw,norm", [
    (" $42$ ", "42"), ("+7", "7"), ("42.0", "42"), ("3.50", "3.50"), ("1,234,567", "1234567"),
    ("50\\%", "50"), ("x = 5", "5"), (r"\dfrac{1}{2}", "(1)/(2)"), (r"\frac12", "1/2"),
    (r"\text{ 5 apples}", "5apples"), ("90^\\circ", "90"), ("−3", "-3"), ("(1, 2)", "(1,2)"),
])
def test_normalize(raw, norm):
    assert normalize(raw) == norm


@pytest.mark.parametrize("raw,value", [
    ("3", Fraction(3)), ("-3", Fraction(-3)), ("0.5", Fraction(1, 2)), (".25", Fraction(1, 4)),
    ("3/4", Fraction(3, 4)), (r"\frac{3}{4}", Fraction(3, 4)), (r"-\frac{3}{4}", Fraction(-3, 4)),
    (r"\frac{-3}{4}", Fraction(-3, 4)), ("1,000", Fraction(1000)), ("2.50", Fraction(5, 2)),
    ("1/0", None), ("x+1", None), ("1/2/3", None), ("", None),
])
def test_to_rational(raw, value):
    assert to_rational(raw) == value


@pytest.mark.parametrize("raw", ["0", "7", "-7", "+7", " 046 ", "-0", "\t12\n", "123456789012345678901234567890",
                                 "+-3", "3 4", "٣", "−3", "1_000", "0x10", "12."])
def test_to_rational_of_plain_integers_agrees_with_the_general_path(raw):
    """Plain integers skip normalize: the value must be what normalize and the parser give."""
    from asyncflow.rewards.math_verify import _plain_rational
    general = _plain_rational(normalize(raw))
    assert to_rational(raw) == general
    assert type(to_rational(raw)) is type(general)


@pytest.mark.parametrize("response,answer", [
    (r"The answer is \boxed{72}.", "72"),
    ("Natalia sold 24 clips in May.\n#### 72", "72"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{\$18}", "18"),
    (r"\boxed{+5}", "5"),
    (r"\boxed{5.0}", "5"),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{0.5}", "1/2"),
    (r"\boxed{\frac{2}{4}}", "1/2"),
    (r"\boxed{-\frac{3}{4}}", "-3/4"),
    (r"\boxed{\frac{-3}{4}}", r"-\frac{3}{4}"),
    (r"\boxed{25\%}", "25"),
    (r"\boxed{x = -2}", "-2"),
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),
    (r"\boxed{(1, 2)}", "(1,2)"),
    ("so the total is 18 dollars.", "18"),
    ("We get 3/4 of the pie", "0.75"),
    ("it is 7", r"the reference is \boxed{7}"),
])
def test_correct_answers_score_one(response, answer):
    assert math_reward(response, answer) == 1.0


@pytest.mark.parametrize("response,answer", [
    (r"\boxed{71}", "72"),
    (r"\boxed{-5}", "5"),
    (r"\boxed{\frac{1}{3}}", "0.33"),
    (r"\boxed{1/2}", "2"),
    ("72 was wrong, it is 73", "72"),
    (r"first \boxed{72} then \boxed{73}", "72"),
    ("no answer at all", "72"),
    (r"\boxed{}", "0"),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}"),
    (r"\boxed{1000}", "100"),
    (r"\boxed{71", "72"),
])
def test_wrong_answers_score_zero(response, answer):
    assert math_reward(response, answer) == 0.0


def test_unclosed_box_falls_back_to_the_last_number():
    assert math_reward(r"\boxed{72", "72") == 1.0


def test_math_equal_symmetry_and_strings():
    assert math_equal("1/2", "0.5") and math_equal("0.5", "1/2")
    assert math_equal("A", " A ")
    assert not math_equal("", "")


# Equivalent forms that exact rationals and normalised strings cannot see; math-verify can.
EQUIVALENT = [
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}"),
    (r"\boxed{(0.5, 1]}", r"\left(\frac{1}{2}, 1\right]"),
    (r"\boxed{\left(1,\sqrt{4}\right]}", r"(1, 2]"),
    (r"\boxed{2, 1}", r"\{1, 2\}"),
    (r"\boxed{\{2,1\}}", r"\{1,2\}"),
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}"),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2"),
    (r"\boxed{(x+1)^2}", r"x^2+2x+1"),
    (r"The answer is \boxed{\frac{\sqrt{12}}{2}}.", r"\sqrt{3}"),
]


@pytest.mark.parametrize("response,answer", [
    (r"\boxed{(1,2]}", r"(1, 2]"),
    (r"\boxed{\left(1,2\right]}", r"(1,2]"),
    (r"so $x$ lies in \boxed{[0, \infty)}", r"[0,\infty)"),
])
def test_spacing_and_delimiter_sizes_are_equal_as_normalised_strings(response, answer):
    """These never needed a solver: normalize drops spaces and \\left / \\right."""
    assert normalize(extract_answer(response)) == normalize(answer)
    assert math_reward(response, answer) == 1.0


@pytest.mark.parametrize("response,answer", EQUIVALENT)
def test_equivalent_forms_score_one(response, answer):
    pred = extract_answer(response)
    gold = extract_boxed(answer) if "\\boxed" in answer else answer
    # Out of reach of the fast paths: not both plain numbers, not the same string.
    assert (to_rational(pred) is None or to_rational(gold) is None) and normalize(pred) != normalize(gold)
    assert math_reward(response, answer) == 1.0


@pytest.mark.parametrize("response,answer", [
    (r"\boxed{\sqrt{2}}", r"2\sqrt{2}"),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{8}"),
    (r"\boxed{[1,2]}", r"(1,2]"),
    (r"\boxed{(1,2)}", r"(1,2]"),
    (r"\boxed{[1,2)}", r"(1,2]"),
    (r"\boxed{1, 3}", r"\{1, 2\}"),
    (r"\boxed{1}", r"\{1, 2\}"),
    (r"\boxed{\{1, 2, 3\}}", r"\{1, 2\}"),
    (r"\boxed{\pi}", r"\frac{\pi}{2}"),
    (r"\boxed{\pi/3}", r"\frac{\pi}{2}"),
    (r"\boxed{(x-1)^2}", r"x^2+2x+1"),
    (r"\boxed{\frac{1}{2}}", r"\frac{\pi}{2}"),
    (r"\boxed{\text{no}}", r"\text{yes}"),
    (r"\boxed{B}", "A"),
    # Both plain numbers: the exact verdict stands, math-verify's 6-digit rounding never gets a say.
    (r"\boxed{0.333333}", r"\frac{1}{3}"),
    (r"\boxed{1.570796}", r"\frac{3}{2}"),
])
def test_wrong_forms_stay_wrong(response, answer):
    assert math_reward(response, answer) == 0.0


def test_symbolic_equal_refuses_empty_sides():
    assert not symbolic_equal("", r"\sqrt{2}") and not symbolic_equal(r"\sqrt{2}", "  ")


def test_the_registered_math_reward_is_this_one():
    assert get_reward("math") is math_reward


def test_math_verify_is_imported_only_when_the_fast_paths_cannot_decide():
    code = (
        "import sys\n"
        "from asyncflow.rewards import math_reward\n"
        "assert math_reward(r'\\boxed{\\frac{2}{4}}', '0.5') == 1.0\n"
        "assert math_reward(r'\\boxed{x = 5}', 'x=5') == 1.0\n"
        "print('math_verify' in sys.modules, 'latex2sympy2_extended' in sys.modules)\n"
        "assert math_reward(r'\\boxed{2\\sqrt{2}}', r'\\sqrt{8}') == 1.0\n"
        "print('math_verify' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True"]


def _in_thread(fn, *args):
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive()
    return box


def test_math_verify_itself_refuses_worker_threads_with_its_default_timeouts():
    """Why we turn its timeouts off there: signal.alarm works only in the main thread."""
    import math_verify

    box = _in_thread(math_verify.parse, r"\boxed{\sqrt{8}}")
    assert isinstance(box.get("error"), ValueError) and "threaded environment" in str(box["error"])


def test_math_reward_works_on_a_worker_thread():
    box = _in_thread(lambda: [math_reward(r, a) for r, a in EQUIVALENT[:5]] + [math_reward(r"\boxed{\pi}", r"\pi/2")])
    assert "error" not in box, box.get("error")
    assert box["value"] == [1.0] * 5 + [0.0]


def test_reward_runner_scores_math_on_its_worker_threads():
    responses = [r for r, _ in EQUIVALENT] + [r"\boxed{\sqrt{2}}", "#### 72"]
    answers = [a for _, a in EQUIVALENT] + [r"2\sqrt{2}", "72"]
    with RewardRunner("math", timeout_s=60, on_error="fail") as runner:
        scores, stats = runner.score(responses, answers)
    assert scores == [1.0] * len(EQUIVALENT) + [0.0, 1.0]
    assert stats["errors"] == 0 and stats["timeouts"] == 0


class _FakeMathVerify:
    """Records the timeouts math-verify is called with."""

    def __init__(self):
        self.calls = []

    def parse(self, text, parsing_timeout):
        self.calls.append(("parse", parsing_timeout))
        return [text]

    def verify(self, gold, pred, timeout_seconds):
        self.calls.append(("verify", timeout_seconds))
        return True


def test_signal_timeouts_only_in_the_main_thread_with_no_alarm_pending(monkeypatch):
    fake = _FakeMathVerify()
    monkeypatch.setattr(mv_mod, "_MATH_VERIFY", fake)
    timed = [("parse", mv_mod.PARSE_TIMEOUT_S)] * 2 + [("verify", mv_mod.VERIFY_TIMEOUT_S)]
    untimed = [("parse", None)] * 2 + [("verify", None)]

    monkeypatch.setattr(mv_mod.signal, "getitimer", lambda which: (0.0, 0.0))  # no alarm pending
    assert symbolic_equal("a", "b") and fake.calls == timed
    fake.calls.clear()
    assert _in_thread(symbolic_equal, "a", "b") == {"value": True} and fake.calls == untimed
    fake.calls.clear()
    monkeypatch.setattr(mv_mod.signal, "getitimer", lambda which: (12.5, 0.0))  # someone's alarm pending
    assert symbolic_equal("a", "b") and fake.calls == untimed


def test_a_pending_alarm_survives_a_symbolic_check():
    """math-verify's signal timeout ends with alarm(0); a caller's timer (pytest-timeout's
    too) must still be armed afterwards."""
    before = signal.getitimer(signal.ITIMER_REAL)
    ours = before[0] == 0.0
    if ours:
        signal.setitimer(signal.ITIMER_REAL, 120.0)
    try:
        assert math_reward(r"\boxed{2\sqrt{2}}", r"\sqrt{8}") == 1.0
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0.0
    finally:
        if ours:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
