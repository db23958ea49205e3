"""Episodes: a conversation built turn by turn (model tokens trained, tool and environment
text not), its limits, and many episodes running at once on one rollout service whose
running batch their turns share."""
from __future__ import annotations

import asyncio
import sys
import types

import pytest
import torch

from asyncflow.agents.episode import EpisodeContext, EpisodeLimits, Trajectory
from asyncflow.engines.rollout.base import RequestResult, SamplingParams


class CharTok:
    """One token per character (ids = ord - 30); eos is id 1."""
    eos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 30 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 1 else chr(i + 30) for i in ids)


def _ctx(replies, limits=None, version=3):
    """A context whose model answers each turn with the next text of ``replies``."""
    limits = EpisodeLimits(4, 64) if limits is None else limits
    tok, calls = CharTok(), []

    async def generate(req):
        calls.append(req)
        ids = tok.encode(replies[len(calls) - 1])[:req.budget]
        return RequestResult(req.request_id, torch.tensor(ids), torch.full((len(ids),), -0.5),
                             torch.full((len(ids),), version), "stop")
    row = {"prompt_ids": tok.encode("1+2="), "prompt": "1+2=", "answer": "3", "seed": 7}
    return EpisodeContext(row, generate=generate, tokenizer=tok, params=SamplingParams(max_new_tokens=8),
                          limits=limits, min_version=2, request_id=("t", 0)), calls


def test_turns_env_text_and_masks():
    ctx, calls = _ctx(["<1+2>", "3"])

    async def episode():
        conv = ctx.start()
        assert await conv.model(stop=">") == "<1+2>"
        conv.env("3#")
        assert await conv.model() == "3"
        return conv.finish(1.0, custom=2)
    t = asyncio.run(episode())
    assert isinstance(t, Trajectory) and t.reward == 1.0 and t.finish_reason == "stop"
    assert CharTok().decode(t.response_ids.tolist()) == "<1+2>3#3"
    assert t.loss_mask.tolist() == [1] * 5 + [0, 0] + [1]
    assert t.log_probs.tolist() == [-0.5] * 5 + [0.0, 0.0] + [-0.5]
    assert t.turn_starts == [0, 7] and t.gen_version == 3
    assert t.metrics["turns"] == 2 and t.metrics["custom"] == 2
    # each turn continues the whole conversation, under the row's staleness bound, with its own seed
    assert calls[1].prompt_ids.tolist() == CharTok().encode("1+2=<1+2>3#")
    assert {c.min_version for c in calls} == {2} and calls[0].seed != calls[1].seed
    assert CharTok().encode(">")[0] in calls[0].params.stop_token_ids


def test_limits_end_the_episode_with_their_reason():
    ctx, _ = _ctx(["aaaa"] * 5, limits=EpisodeLimits(max_turns=2, max_tokens=64))

    async def turns():
        conv = ctx.start()
        while not conv.done:
            await conv.model()
        with pytest.raises(RuntimeError, match="after it ended"):
            await conv.model()
        return conv.finish(0.0)
    assert asyncio.run(turns()).finish_reason == "max_turns"

    ctx, calls = _ctx(["abcdefgh"] * 5, limits=EpisodeLimits(max_turns=9, max_tokens=10))

    async def tokens():
        conv = ctx.start()
        while not conv.done:
            await conv.model()
            conv.env("xyz")
        return conv.finish(0.0)
    t = asyncio.run(tokens())
    assert t.finish_reason == "max_tokens" and len(t.response_ids) == 10
    assert len(calls) == 1 and calls[0].budget == 8  # 8 model tokens, then "xyz" cut to the 2 left


def test_a_stop_string_must_be_one_token():
    ctx, _ = _ctx(["x"])
    with pytest.raises(ValueError, match="one token"):
        ctx.stop_ids(">>")


# ---- on a real rollout service ----------------------------------------------------------------

@pytest.fixture(scope="module")
def service():
    import tempfile

    from asyncflow.engines.rollout.builtin import BuiltinRolloutEngine
    from asyncflow.engines.rollout.service import RolloutService
    from asyncflow.models.loading import load_causal_lm, load_tokenizer
    from asyncflow.models.tiny import TinyModelSpec, build_tiny_model
    d = build_tiny_model(tempfile.mkdtemp(), TinyModelSpec(hidden_size=64, intermediate_size=128))
    tok = load_tokenizer(d)
    engine = BuiltinRolloutEngine(load_causal_lm(d), eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    engine.version = 0
    svc = RolloutService(engine)
    yield svc, tok
    svc.close()


def _register(name: str, fn) -> str:
    mod = types.ModuleType(f"_episodes_{name}")
    setattr(mod, name, fn)
    sys.modules[mod.__name__] = mod
    return f"{mod.__name__}:{name}"


async def two_turns(row, ctx):
    conv = ctx.start()
    await conv.model(max_new_tokens=5)
    conv.env("=")
    await conv.model(max_new_tokens=4)
    return conv.finish(float(len(conv.ids)))


def test_episodes_run_concurrently_and_share_the_running_batch(service):
    from asyncflow.agents.runner import EpisodeRunner, episode_columns
    svc, tok = service
    runner = EpisodeRunner(svc, tok, EpisodeLimits(4, 32), name="t")
    path = _register("two_turns", two_turns)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    before = svc.engine.counters["steps"]
    futs = [runner.start(path, {"prompt_ids": tok.encode(f"{i}+{i}=", add_special_tokens=False), "seed": i},
                         params, 0, ("t", i)) for i in range(16)]
    trajs = [f.result(60) for f in futs]
    runner.close()
    assert all(t.finish_reason in ("stop", "max_turns") for t in trajs)
    for t in trajs:
        assert len(t.response_ids) == len(t.loss_mask) == len(t.log_probs) == len(t.token_versions)
        assert (t.loss_mask == 0).sum() == 1  # the "=" between the turns
    assert runner.snapshot()["episodes"] == 16 and runner.snapshot()["turns"] == 32
    # 16 episodes of 2 turns of up to 9 tokens each: run one after another that is >= 144 decode
    # steps; sharing the running batch it is a small fraction of that
    assert svc.engine.counters["steps"] - before < 100
    cols = episode_columns(trajs, 0)
    assert cols["loss_mask"][0].dtype == torch.int8 and cols["scores"].shape == (16,)
    assert cols["episode"][0]["turns"] == 2


async def broken(row, ctx):
    raise KeyError("no such field")


def test_an_episode_that_raises_gives_an_error_trajectory_naming_it(service):
    from asyncflow.agents.runner import EpisodeRunner
    svc, tok = service
    runner = EpisodeRunner(svc, tok, EpisodeLimits(), name="t")
    t = runner.start(_register("broken", broken), {"prompt_ids": [3], "prompt": "p"}, SamplingParams(), 0,
                     ("t", 0)).result(30)
    runner.close()
    assert t.finish_reason == "error" and "KeyError" in t.error and "broken" in t.error


def test_an_episode_must_be_an_async_function():
    from asyncflow.agents.runner import load_episode
    with pytest.raises(ValueError, match="async function"):
        load_episode(_register("plain", lambda row, ctx: None))
    with pytest.raises(ValueError, match="cannot load"):
        load_episode("no_such_module_xyz:fn")


def test_episode_rows_read_a_tensordict_and_the_queues_columns_alike():
    """An episode's row dicts are the same whether the stage's data came as a TensorDict or as
    the TransferQueue's columns (DP_COMPUTE with columns=True)."""
    from asyncflow.agents.runner import episode_rows
    from asyncflow.transfer_queue.columns import to_column, to_tensordict

    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8])]
    cols = {"prompt_ids": to_column("prompt_ids", prompts), "seed": to_column("seed", torch.tensor([3, 4])),
            "answer": to_column("answer", ["12", "x"]), "metadata": to_column("metadata", [{"k": 1}, {}])}
    want = [{"prompt_ids": [5, 6, 7], "seed": 3, "answer": "12", "metadata": {"k": 1}},
            {"prompt_ids": [8], "seed": 4, "answer": "x", "metadata": {}}]
    assert episode_rows(cols, 2) == want
    assert episode_rows(to_tensordict(cols, 2), 2) == want
