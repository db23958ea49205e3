"""VLLMRolloutEngine on a tiny Qwen2 saved offline. Needs a GPU and vllm: skipped otherwise."""
from __future__ import annotations

import pytest
import torch

from asyncflow.engines.rollout import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM tests need a CUDA GPU")
VOCAB, EOS, PAD = 64, 1, 0


def _tiny_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


def _save_tokenizer(path: str) -> None:
    """A word-level tokenizer over the 64 ids ("<pad>", "</s>", "t2".."t63"): vLLM wants one in the dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": PAD, "</s>": EOS, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>").save_pretrained(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("vllm", reason="vllm is not installed (pip install asyncflow[gpu])")
    from asyncflow.engines.rollout import VLLMRolloutEngine
    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    model = _tiny_model(seed=0)
    model.save_pretrained(path)
    _save_tokenizer(path)
    engine = VLLMRolloutEngine(path, gpu_memory_utilization=0.2, dtype="float32", seed=0, max_model_len=256,
                               enforce_eager=True)
    return engine, model


def _prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g) for _ in range(n)]


def _ref_log_probs(model, prompt, response, temperature):
    seq = torch.cat([prompt, response])[None]
    with torch.inference_mode():
        logits = model(seq).logits[0, prompt.numel() - 1: -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, response[:, None]).squeeze(-1)


def test_generate_log_probs_and_seeding(setup):
    engine, model = setup
    prompts = _prompts(8)
    params = SamplingParams(max_new_tokens=16, temperature=0.8)
    seeds = list(range(8))
    out = engine.generate(prompts, params, seeds=seeds)
    assert set(out.finish_reasons) <= {"stop", "length"}
    for p, r, lp in zip(prompts, out.response_ids, out.log_probs):
        assert r.numel() == lp.numel() > 0
        assert (lp - _ref_log_probs(model, p, r, 0.8)).abs().max().item() < 2e-3
    alone = engine.generate(prompts[3:4], params, seeds=seeds[3:4])
    assert alone.response_ids[0].tolist() == out.response_ids[3].tolist()
    with pytest.raises(ValueError, match="filter"):
        engine.generate(prompts, SamplingParams(top_p=0.9), seeds=seeds)


def test_abort_and_budgets(setup):
    engine, _ = setup
    prompts = _prompts(4, seed=1)
    greedy = SamplingParams(max_new_tokens=40, temperature=0)
    full = engine.generate(prompts, greedy, seeds=[0] * 4)
    budgeted = engine.generate(prompts, greedy, seeds=[0] * 4, max_new_tokens=[0, 5, 40, 40])
    assert budgeted.response_ids[0].numel() == 0 and budgeted.finish_reasons[0] == "length"
    assert budgeted.response_ids[1].tolist() == full.response_ids[1][:5].tolist()
    polls = []

    def should_abort() -> bool:
        polls.append(1)
        return len(polls) > 4

    part = engine.generate(prompts, greedy, seeds=[0] * 4, should_abort=should_abort)
    assert "abort" in part.finish_reasons
    for i in range(4):
        n = part.response_ids[i].numel()
        assert n < 40 or part.finish_reasons[i] != "abort"
        assert part.response_ids[i].tolist() == full.response_ids[i][:n].tolist()
        assert part.log_probs[i].numel() == n


def test_load_weights_and_sleep(setup):
    engine, model = setup
    prompts = _prompts(4, seed=2)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    before = engine.generate(prompts, greedy, seeds=[0] * 4)
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(prompts, greedy, seeds=[0] * 4)
    new = _tiny_model(seed=1).state_dict()
    engine.load_weights(new, version=7)  # while asleep: wakes the weights only
    engine.resume_memory()
    assert engine.version == 7
    after = engine.generate(prompts, greedy, seeds=[0] * 4)
    assert [r.tolist() for r in after.response_ids] != [r.tolist() for r in before.response_ids]
    with pytest.raises(KeyError, match="bogus"):
        engine.load_weights({**new, "bogus.weight": torch.zeros(1)}, version=8)
    engine.load_weights(model.state_dict(), version=9)  # back to the first weights: same outputs
    again = engine.generate(prompts, greedy, seeds=[0] * 4)
    assert [r.tolist() for r in again.response_ids] == [r.tolist() for r in before.response_ids]
