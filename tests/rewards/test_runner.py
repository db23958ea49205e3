"""RewardRunner: batch scoring, errors and timeouts counted or raised, hung threads capped."""
from __future__ import annotations

import threading
import time

import pytest

from asyncflow.rewards import RewardError, RewardRunner

HANG_S = 30  # a hung call is released by the test; this only bounds a broken test's hang


def test_scores_a_batch_with_metadata():
    seen = []

    def fn(response, answer, weight=1.0, **meta):
        seen.append(meta)
        return weight * (response == answer)

    with RewardRunner(fn) as runner:
        scores, stats = runner.score(["1", "2", "3"], ["1", "0", "3"], [{"weight": 2.0}, {}, {"tag": "x"}])
    assert scores == [2.0, 0.0, 1.0]
    assert stats == {"rows": 3, "errors": 0, "timeouts": 0, "hung": 0, "first_error": None, "extra": {}}
    assert seen[2] == {"tag": "x"}


def test_by_name_and_no_metadata():
    scores, stats = RewardRunner("addition").score(["46<eos>", "45"], ["46", "46"])
    assert scores == [1.0, 0.0] and stats["errors"] == 0


def test_length_mismatch():
    with pytest.raises(ValueError, match="2 responses, 1 answers, 2 metadata"):
        RewardRunner("exact_match").score(["a", "b"], ["a"], [{}, {}])


def _flaky(response, answer, **_):
    if response == "boom":
        raise ZeroDivisionError("bad row")
    if response == "nan":
        return float("nan")
    if response == "str":
        return "1.0"
    return 1.0


def test_errors_score_zero_and_are_counted():
    scores, stats = RewardRunner(_flaky).score(["ok", "boom", "nan", "str", "ok"], ["x"] * 5)
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert stats["errors"] == 3 and stats["timeouts"] == 0
    assert "row 1" in stats["first_error"] and "ZeroDivisionError: bad row" in stats["first_error"]


def test_errors_raise_with_function_row_and_cause():
    runner = RewardRunner(_flaky, on_error="fail")
    with pytest.raises(RewardError, match=r"reward '_flaky' failed on row 1: ZeroDivisionError: bad row") as info:
        runner.score(["ok", "boom"], ["x", "x"])
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(RewardError, match=r"row 0: returned nan"):
        runner.score(["nan"], ["x"])


def test_a_dict_result_scores_its_score_and_sums_its_numeric_extras():
    def fn(response, answer, **_):
        if response == "plain":
            return 0.5
        return {"score": float(response == answer), "acc": response == answer, "len": len(response), "pred": response}

    scores, stats = RewardRunner(fn).score(["7", "8", "plain", "77"], ["7"] * 4)
    assert scores == [1.0, 0.0, 0.5, 0.0] and stats["errors"] == 0
    assert stats["extra"] == {"acc": [1.0, 3], "len": [4.0, 3]}  # "pred" is no number: not a metric


def test_a_dict_without_a_numeric_score_is_an_error():
    def fn(response, answer, **_):
        return {"acc": 1.0} if response == "a" else {"score": "1"}

    scores, stats = RewardRunner(fn).score(["a", "b"], ["x", "x"])
    assert scores == [0.0, 0.0] and stats["errors"] == 2 and stats["extra"] == {}
    want = "row 0: returned {'acc': 1.0}, expected a finite float or a dict with a finite 'score'"
    assert want in stats["first_error"]


def test_a_contract_error_stops_scoring_even_under_on_error_zero():
    from asyncflow.rewards import RewardContractError

    def fn(response, answer, **_):
        if response == "bad":
            raise RewardContractError("my_reward returned None")
        return 1.0

    runner = RewardRunner(fn, on_error="zero")
    with pytest.raises(RewardError, match=r"failed on row 1: RewardContractError: my_reward returned None"):
        runner.score(["ok", "bad", "ok"], ["x"] * 3)
    assert runner.score(["ok"], ["x"])[0] == [1.0]  # the queued rows of the failed call do not leak into the next


def test_extra_means_over_a_window():
    from asyncflow.rewards.runner import extra_means
    now = {"acc": [3.0, 4], "len": [10.0, 2]}
    assert extra_means(now) == {"acc": 0.75, "len": 5.0}
    assert extra_means(now, {"acc": [1.0, 2], "len": [10.0, 2]}) == {"acc": 1.0}  # no new "len" row


def test_timeout_scores_zero_and_later_rows_still_score():
    """The hung row is abandoned while its call still runs (it returns 1.0 only once released,
    which happens after score() came back), and the rows after it score on a fresh worker.
    The timeout leaves the quick rows ample time on a loaded machine."""
    entered, release = threading.Event(), threading.Event()

    def slow(response, answer, **_):
        if response == "hang":
            entered.set()
            release.wait(HANG_S)
        return 1.0

    runner = RewardRunner(slow, timeout_s=1.0)
    scores, stats = runner.score(["a", "hang", "b"], ["x"] * 3)
    assert entered.is_set() and not release.is_set()
    assert scores == [1.0, 0.0, 1.0] and stats["timeouts"] == 1 and stats["hung"] == 1
    assert "exceeded timeout_s=1.0 on row 1" in stats["first_error"]
    release.set()
    deadline = time.monotonic() + HANG_S
    while runner.num_hung and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.num_hung == 0  # the abandoned thread exits once its call returns
    runner.close()


def test_timeout_raises_under_fail():
    release = threading.Event()
    runner = RewardRunner(lambda r, a, **_: release.wait(5) and 1.0, timeout_s=0.05, on_error="fail")
    try:
        with pytest.raises(RewardError, match=r"exceeded timeout_s=0.05 on row 0"):
            runner.score(["a"], ["x"])
    finally:
        release.set()


def test_too_many_hung_calls_raise():
    release = threading.Event()

    def hang(response, answer, **_):
        release.wait(10)
        return 0.0

    runner = RewardRunner(hang, timeout_s=0.02, max_abandoned=2)
    try:
        with pytest.raises(RewardError, match=r"3 calls are still running .*threads cannot be killed"):
            runner.score(["a"] * 5, ["x"] * 5)
    finally:
        release.set()


@pytest.mark.parametrize("kwargs,match", [({"on_error": "skip"}, "on_error"), ({"timeout_s": 0}, "timeout_s")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardRunner("exact_match", **kwargs)
