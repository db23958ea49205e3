"""Math answer checking on handmade GSM8K / DeepScaleR-style responses."""
from __future__ import annotations

from fractions import Fraction

import pytest

from asyncflow.rewards import extract_answer, extract_boxed, math_equal, math_reward, normalize
from asyncflow.rewards.math_verify import extract_final_number, to_rational


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
