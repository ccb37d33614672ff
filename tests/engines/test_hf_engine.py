"""HFEngine: seeded sampling, log-probs equal to the trainer's, greedy = argmax, EOS, weight updates."""

import math

import pytest
import torch

from rlkit.embedded.cache import embedded_checkpoint
from rlkit.embedded.model import build_tiny_checkpoint
from rlkit.engines.hf import COMPACT_AT, MIN_DECODE_ROWS, HFEngine, filter_logits
from rlkit.models import load_policy, load_tokenizer

PROMPTS = [[1, 7, 14, 9, 18], [1, 5, 18], [1, 12, 16, 13, 18, 6, 6]]  # three lengths: left padding matters


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def warm():
    return embedded_checkpoint()  # the session's fresh cache (tests/conftest.py): warmed up once per session


@pytest.fixture()
def engine(tiny):
    engine = HFEngine(max_new_tokens=8)
    engine.start(str(tiny))
    return engine


def trainer_logprobs(model, prompt, completion):
    """The trainer's view: one full forward over prompt + completion, log_softmax, gather."""
    ids = torch.tensor([prompt + completion])  # [1, P + T]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [T, V] logits predicting each completion token
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1), logits  # [T], [T, V]


def tokens(result):
    return [g.token_ids for row in result for g in row]


def test_same_seed_same_samples_other_seed_other_samples(engine):
    a, b, c = (engine.generate(PROMPTS, 4, seed=s) for s in (11, 11, 12))
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)
    assert [len(row) for row in a] == [4, 4, 4]


def test_logprobs_match_the_trainer(engine, tiny):
    model = load_policy(tiny)
    for prompt, row in zip(PROMPTS, engine.generate(PROMPTS, 3, seed=0), strict=True):
        for g in row:
            expected, _ = trainer_logprobs(model, prompt, g.token_ids)
            torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=1e-5, rtol=0)


def test_logprobs_are_untempered(tiny):
    """At temperature 2 and top-k 3 the sampling distribution changes, the reported log-probs do not."""
    engine = HFEngine(max_new_tokens=6, temperature=2.0, top_k=3)
    engine.start(str(tiny))
    model = load_policy(tiny)
    for prompt, row in zip(PROMPTS, engine.generate(PROMPTS, 2, seed=1), strict=True):
        for g in row:
            expected, logits = trainer_logprobs(model, prompt, g.token_ids)
            torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=1e-5, rtol=0)
            top3 = logits.topk(3, dim=-1).indices  # [T, 3]
            assert (top3 == torch.tensor(g.token_ids)[:, None]).any(dim=1).all()


def test_greedy_is_argmax_and_repeated_n_times(engine, tiny):
    model = load_policy(tiny)
    result = engine.generate(PROMPTS, 2, seed=0, greedy=True)
    for prompt, row in zip(PROMPTS, result, strict=True):
        assert row[0].token_ids == row[1].token_ids
        _, logits = trainer_logprobs(model, prompt, row[0].token_ids)
        assert logits.argmax(-1).tolist() == row[0].token_ids


def test_sampling_frequencies_follow_the_tempered_distribution(engine, tiny):
    """First tokens of 4000 samples at temperature 1.5: frequencies ~ softmax(logits / 1.5) (4 sigma)."""
    model = load_policy(tiny)
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # peaked logits, so that temperature 1 and 1.5 differ clearly
    engine.update_weights(model.named_parameters())
    engine.temperature = 1.5
    prompt = PROMPTS[0]
    first = torch.tensor([g.token_ids[0] for g in engine.generate([prompt], 4000, seed=5)[0]])  # [4000]
    with torch.no_grad():
        probs = (model(torch.tensor([prompt])).logits[0, -1] / 1.5).softmax(-1)  # [V]
    assert probs.max() > 0.2
    freq = torch.bincount(first, minlength=probs.numel()).double() / 4000  # [V]
    sigma = (probs * (1 - probs) / 4000).sqrt()
    assert ((freq - probs).abs() <= 4 * sigma + 1e-3).all()


def test_stops_at_eos_per_row(warm):
    """The warmed model answers and emits EOS; rows stop independently, EOS is last and only there."""
    engine = HFEngine(max_new_tokens=8)
    engine.start(str(warm))
    tokenizer = load_tokenizer(warm)
    prompts = [tokenizer(q)["input_ids"] for q in ["3+5=", "9+8=", "0+0=", "7+7="]]
    result = engine.generate(prompts, 8, seed=0)
    eos = tokenizer.eos_token_id
    generations = [g for row in result for g in row]
    assert any(g.finished for g in generations)
    assert len({len(g.token_ids) for g in generations}) > 1  # rows of different lengths in one batch
    for g in generations:
        assert len(g.token_ids) == len(g.logprobs) <= 8
        assert g.finished == (g.token_ids[-1] == eos)
        assert eos not in g.token_ids[:-1]
        assert g.finished or len(g.token_ids) == 8


class NoDropEngine(HFEngine):
    """The decoding before finished rows left the batch: every row decodes until the last one stops."""

    @staticmethod
    def _decode_rows(live):
        return None


@pytest.mark.parametrize(
    "settings",
    [{}, {"temperature": 1.7, "top_k": 5}, {"top_p": 0.8}, {"greedy": True}],
    ids=["t1", "topk", "topp", "greedy"],
)
def test_dropping_finished_rows_changes_nothing(warm, tiny, settings):
    """Tokens and finished flags are those of decoding every row to the end, log-probs equal to rounding.

    Dropping rows changes the decode batch's shape, hence the matmuls' float rounding on some CPUs (in
    float32 a log-prob moved by 5e-7 on one): the engines run in float64, where rounding is ~1e-16 and a
    row that saw another's cache or a wrong position would change its tokens outright."""
    settings = dict(settings)
    greedy = settings.pop("greedy", False)
    for checkpoint in (warm, tiny):  # warm: most rows stop after 2-3 tokens; tiny: rows of every length
        dropping = HFEngine(max_new_tokens=12, dtype="float64", **settings)
        full = NoDropEngine(max_new_tokens=12, dtype="float64", **settings)
        dropping.start(str(checkpoint))
        full.start(str(checkpoint))
        for seed in range(3):
            a = dropping.generate(PROMPTS * 2, 6, seed=seed, greedy=greedy)
            b = full.generate(PROMPTS * 2, 6, seed=seed, greedy=greedy)
            assert [(g.token_ids, g.finished) for row in a for g in row] == [
                (g.token_ids, g.finished) for row in b for g in row
            ]
            for x, y in zip((g for row in a for g in row), (g for row in b for g in row), strict=True):
                torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-12, rtol=0)


def test_finished_rows_leave_the_decode_batch_and_decoding_stops_with_the_last(warm):
    engine = HFEngine(max_new_tokens=16)
    engine.start(str(warm))
    tokenizer = load_tokenizer(warm)
    sizes = []
    engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    prompts = [tokenizer(q)["input_ids"] for q in ["3+5=", "9+8=", "0+0=", "7+7="]]
    result = engine.generate(prompts, 8, seed=0)
    lengths = [len(g.token_ids) for row in result for g in row]
    prefill, decode = sizes[0], sizes[1:]
    assert prefill == 4 and decode[0] == 32
    assert len(decode) == max(lengths) - 1  # no step after the last row stopped
    # finished rows leave once the running ones are at most COMPACT_AT of the batch; the batch keeps the
    # rows still running (at least MIN_DECODE_ROWS, finished ones filling up)
    running = [sum(n > t for n in lengths) for t in range(1, max(lengths))]
    expected, batch = [], 32
    for r in running:
        if r <= COMPACT_AT * batch and batch > MIN_DECODE_ROWS:
            batch = max(r, MIN_DECODE_ROWS)
        expected.append(batch)
    assert decode == expected
    assert decode[-1] < decode[0]


def test_samples_do_not_depend_on_the_other_prompts(tiny):
    """A prompt decoded alone samples the same tokens (its own seeds); log-probs agree to rounding."""
    engine = HFEngine(max_new_tokens=10)
    engine.start(str(tiny))
    seeds = [5, 6, 7]
    together = engine.generate(PROMPTS, 5, seed=seeds)
    for prompt, seed, row in zip(PROMPTS, seeds, together, strict=True):
        [alone] = engine.generate([prompt], 5, seed=[seed])
        assert [g.token_ids for g in alone] == [g.token_ids for g in row]
        for a, b in zip(alone, row, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_update_weights_changes_outputs(tiny):
    """After a push the engine samples from the new weights: its log-probs are the trainer's (in float64,
    where rounding cannot blur a stale weight: float32 gaps reached 1.3e-5 on one CPU)."""
    engine = HFEngine(max_new_tokens=8, dtype="float64")
    engine.start(str(tiny))
    model = load_policy(tiny, dtype=torch.float64)
    before = engine.generate(PROMPTS, 1, seed=0, greedy=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=generator))
    engine.update_weights(model.named_parameters())
    after = engine.generate(PROMPTS, 1, seed=0, greedy=True)
    assert tokens(before) != tokens(after)
    for prompt, [g] in zip(PROMPTS, after, strict=True):
        expected, _ = trainer_logprobs(model, prompt, g.token_ids)
        torch.testing.assert_close(torch.tensor(g.logprobs, dtype=torch.float64), expected, atol=1e-10, rtol=0)


def test_update_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(KeyError, match="no parameter 'policy.lm_head.weight'"):
        engine.update_weights([("policy.lm_head.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.update_weights([("lm_head.weight", torch.zeros(3))])


def test_filter_logits_hand_worked():
    # probabilities 0.5, 0.3, 0.2: mass of the more likely tokens is 0, 0.5, 0.8.
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    inf = float("-inf")
    kept = lambda k, p: filter_logits(logits, k, p).isfinite()[0].tolist()  # noqa: E731
    assert kept(0, 1.0) == [True, True, True]
    assert kept(2, 1.0) == [True, True, False]
    assert kept(0, 0.6) == [True, True, False]  # 0.5 < 0.6: the second token is still needed
    assert kept(0, 0.5) == [True, False, False]  # 0.5 alone reaches 0.5
    assert kept(0, 0.01) == [True, False, False]  # the most likely token always stays
    shuffled = logits[:, [2, 0, 1]]  # vocabulary order does not matter
    assert filter_logits(shuffled, 0, 0.6)[0, 0].item() == inf


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "greedy=True"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"dtype": "fp32"}, "dtype"),
    ],
)
def test_invalid_settings_raise(kwargs, words):
    with pytest.raises(ValueError, match=words):
        HFEngine(**kwargs)


def test_start_on_missing_checkpoint_and_generate_before_start(tmp_path):
    engine = HFEngine()
    with pytest.raises(RuntimeError, match="start"):
        engine.generate(PROMPTS, 1, 0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.start(str(tmp_path / "missing"))
