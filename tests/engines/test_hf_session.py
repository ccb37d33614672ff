"""HFEngine(reuse_kv_cache=True): a KVSession continues each row from its KV cache, feeding only the new tokens,
and samples what re-encoding the whole row samples.

What is exactly equal and what is not: both paths run the same tokens at the same positions (the session's
rows are padded differently, in the middle rather than on the left, and masked) with the same per-sample
uniforms, so the maths is the same and only the float rounding of other matmul shapes differs. In float64
that rounding is ~1e-16, far below any CDF gap a uniform could fall into: tokens are identical and log-probs
agree to 1e-10. In float32 the rounding is ~1e-7 (measured: 4.8e-7): tokens are identical on these seeds
(a token could flip only where a uniform lies within ~1e-7 of a CDF boundary) and log-probs agree to 1e-5,
the tolerance the other HFEngine tests use for batch-shape rounding.
"""

import pytest
import torch

from rlkit.data.prompts import encode_prompt
from rlkit.embedded import RevealedChain
from rlkit.embedded.cache import embedded_checkpoint
from rlkit.embedded.model import build_tiny_checkpoint
from rlkit.engines.hf import HFEngine
from rlkit.environments import Environment, EpisodeRunner, Observation
from rlkit.errors import ConfigError
from rlkit.models import load_tokenizer

PROMPTS = [[1, 7, 14, 9, 18], [1, 5, 18], [1, 12, 16, 13, 18, 6, 6]]  # three lengths: left padding matters
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3))


@pytest.fixture(scope="module")
def warm():
    return str(embedded_checkpoint())  # the session's cache (tests/conftest.py): warmed up once per session


def engines(checkpoint, **settings):
    plain, cached = HFEngine(**settings), HFEngine(reuse_kv_cache=True, **settings)
    plain.start(checkpoint)
    cached.start(checkpoint)
    return plain, cached


def assert_same(a, b, dtype):
    assert [(g.token_ids, g.finished) for row in a for g in row] == [
        (g.token_ids, g.finished) for row in b for g in row
    ]
    for x, y in zip((g for row in a for g in row), (g for row in b for g in row), strict=True):
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=TOLERANCE[dtype], rtol=0, check_dtype=False
        )


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_continued_turns_sample_what_re_encoding_samples(tiny, dtype, greedy):
    """Three turns of rows of several lengths with observations of 1-4 tokens: each turn, the session and a
    plain engine given the whole rows return the same tokens, and the session prefilled only the new tokens."""
    plain, cached = engines(tiny, max_new_tokens=8, dtype=dtype)
    widths = []
    cached.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    contexts, observations = [list(p) for p in PROMPTS for _ in range(3)], []
    with cached.session() as session:
        for turn in range(3):
            seeds = [100 * turn + i for i in range(len(contexts))]
            widths.clear()
            expected = plain.generate(contexts, 1, seed=seeds, greedy=greedy)
            assert_same(session.generate(contexts, 1, seed=seeds, greedy=greedy), expected, dtype)
            if turn:  # the prefill: the observation and the last token when it was not fed back (cut by the limit)
                assert max(len(o) for o in observations) <= widths[0] <= 1 + max(len(o) for o in observations)
            else:
                assert widths[0] == max(len(c) for c in contexts)
            observations = [[5 + i % 3] * (1 + i % 4) for i in range(len(contexts))]
            contexts = [c + g.token_ids + o for c, [g], o in zip(contexts, expected, observations, strict=True)]
        assert session.reused_tokens > 0


def test_rows_that_left_the_decode_batch_continue_from_their_cache(warm):
    """The warmed model stops most rows after 2-3 tokens, so finished rows leave the decode batch (their cache
    kept apart) and their EOS was or was not fed back; n > 1 repeats a prompt's cache; a context not from the
    previous call is prefilled whole beside the continued ones."""
    plain, cached = engines(warm, max_new_tokens=8, dtype="float64")
    tokenizer = load_tokenizer(warm)
    prompts = [tokenizer(q)["input_ids"] for q in ["3+5=", "9+8=", "0+0=", "7+7="]]
    with cached.session() as session:
        first = session.generate(prompts, 8, seed=0)
        assert_same(first, plain.generate(prompts, 8, seed=0), "float64")
        plus = tokenizer(",4+4=", add_special_tokens=False)["input_ids"]
        contexts = [p + g.token_ids + plus for p, row in zip(prompts, first, strict=True) for g in row]
        contexts.append(tokenizer("6+1=")["input_ids"])  # new: no cached row
        assert len({len(g.token_ids) for row in first for g in row}) > 1  # rows of several lengths
        assert_same(session.generate(contexts, 2, seed=1), plain.generate(contexts, 2, seed=1), "float64")
        assert session.reused_tokens >= sum(len(c) - len(plus) - 1 for c in contexts[:-1])


class NextQuestion(Environment):
    """Plain text: after each turn, a new question for the single-turn model (``",1+2="``)."""

    max_turns = 3

    def reset(self, prompt):
        return 0

    def step(self, state, text):
        return Observation(text=",1+2=")


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_episodes_are_the_same_with_and_without_the_cache(warm, greedy):
    """Episodes through EpisodeRunner: equal rows, masks and log-probs whether the engine continues each turn
    from the cache or re-encodes the row."""
    plain, cached = engines(warm, max_new_tokens=8, dtype="float64")
    tokenizer = load_tokenizer(warm)
    prompts = [RevealedChain(num_prompts=16, min_terms=3, max_terms=4, split="test")[i] for i in range(6)]
    ids = [encode_prompt(p, tokenizer) for p in prompts]
    seeds = list(range(len(prompts)))
    fed = {plain: 0, cached: 0}  # tokens run through each engine's model
    for engine in fed:
        engine.model.register_forward_pre_hook(
            lambda module, args, kwargs, engine=engine: fed.update({engine: fed[engine] + kwargs["input_ids"].numel()}),
            with_kwargs=True,
        )
    a = EpisodeRunner(NextQuestion(), plain, tokenizer).run(prompts, ids, 4, seeds, greedy=greedy)
    b = EpisodeRunner(NextQuestion(), cached, tokenizer).run(prompts, ids, 4, seeds, greedy=greedy)
    assert fed[cached] < fed[plain]  # later turns fed only their new tokens
    assert max(e.turns for row in a for e in row) > 1  # some episodes took several turns
    assert [(e.token_ids, e.model_mask, e.turn_spans) for row in a for e in row] == [
        (e.token_ids, e.model_mask, e.turn_spans) for row in b for e in row
    ]
    assert_same(a, b, "float64")


def test_off_by_default_and_the_plain_path_is_the_engine():
    engine = HFEngine()
    assert not engine.reuse_kv_cache
    with engine.session() as generator:
        assert generator is engine


def test_a_weight_push_drops_the_cache(tiny):
    """After update_weights inside a session, the next turn is what the new weights give on the whole rows
    (a cache computed by the old weights would move its log-probs)."""
    plain, cached = engines(tiny, max_new_tokens=6, dtype="float64")
    generator = torch.Generator().manual_seed(0)
    new = {
        k: v + 0.3 * torch.randn(v.shape, generator=generator, dtype=v.dtype)
        for k, v in plain.model.state_dict().items()
    }
    with cached.session() as session:
        first = session.generate(PROMPTS, 1, seed=[1, 2, 3])
        contexts = [p + g.token_ids + [5, 6] for p, [g] in zip(PROMPTS, first, strict=True)]
        plain.update_weights(new.items())
        cached.update_weights(new.items())
        assert_same(
            session.generate(contexts, 1, seed=[4, 5, 6]), plain.generate(contexts, 1, seed=[4, 5, 6]), "float64"
        )
        assert session.reused_tokens == 0


def test_a_sliding_window_model_is_refused_in_one_line(tmp_path):
    """A sliding-window layer's cache drops old columns, so a cached row could not be continued."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlkit.embedded.model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = HFEngine(max_new_tokens=2, reuse_kv_cache=True)
    engine.start(str(tmp_path))
    with engine.session() as session, pytest.raises(ConfigError, match="sliding-window.*reuse_kv_cache: false"):
        session.generate(PROMPTS, 1, seed=0)
