"""Both engines on a model of real shape: preset ``qwen2-test`` (Qwen2, grouped-query attention 4:2, head_dim
64, untied LM head, q/k/v biases, a vocabulary padded past the tokenizer, a ChatML byte-level BPE).

What the embedded character-level Llama cannot show: chat-templated prompts that stop at ``<|im_end|>`` or
``<|endoftext|>``, GQA in the engines' KV caches, in packed forwards and in weight pushes (vLLM stacks q, k
and v into one matrix), an LM head that is not the embedding, and an exported checkpoint that transformers
and vLLM load back. One vLLM engine for the module, started from the exported checkpoint; each vLLM test
pushes the weights it needs, so the tests do not depend on their order.
"""

from types import SimpleNamespace

import pytest
import torch
from residual_weights import predicts
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlkit.algorithms import PolicyGradient
from rlkit.callbacks import ExportHF
from rlkit.components import GroupMean, PPOClip, TokenMean, TokenRatio
from rlkit.data.batch import Rollout
from rlkit.data.prompts import Prompt, encode_prompt
from rlkit.engines.hf import HFEngine
from rlkit.engines.vllm import VLLMEngine
from rlkit.model_presets import preset_checkpoint
from rlkit.models import load_tokenizer
from rlkit.spine.policy import Policy

#: A system prompt longer than vLLM's CPU KV block (128 tokens): only full blocks enter the prefix cache,
#: whose KV from old weights a push must invalidate.
LONG_SYSTEM = " ".join(
    f"Rule {i}: the {animal} counts {i} apples near the river, and writes the sum down."
    for i, animal in enumerate(["dog", "cat", "bird", "farmer", "doctor", "baker"] * 2)
)
CHATS = [
    [{"role": "user", "content": "What is 3+5+7?"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Ada sees a lamp."}],
    [
        {"role": "user", "content": "def add(x, y):"},
        {"role": "assistant", "content": "    return x + y"},
        {"role": "user", "content": "Now compute 12*7."},
    ],
    [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "How many apples?"}],
]
#: fp32 engines against the trainer's fp32 forward: measured <= 1e-6 here (DESIGN.md: 1e-6); 1e-5 leaves
#: room for other CPUs' kernels while a wrong weight (a dropped bias, a tied head) moves them by > 1e-3.
FP32_TOLERANCE = 1e-5
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint():
    return preset_checkpoint("qwen2-test")  # built once per session (tests/conftest.py's fresh cache)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [encode_prompt(Prompt(chat), tokenizer) for chat in CHATS]


def rollout_of(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> Rollout:
    """The trainer's layout of prompt ``i`` + completion ``i``: left-padded prompts, right-padded completions."""
    P, T = max(map(len, prompts)), max(1, *map(len, completions))
    ids = torch.full((len(prompts), P + T), pad_id)  # [N, P + T]
    mask = torch.zeros((len(prompts), P + T), dtype=torch.long)  # [N, P + T]
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, P - len(p) : P + len(c)] = torch.tensor(p + c)
        mask[i, P - len(p) : P + len(c)] = 1
    N = len(prompts)
    return Rollout(
        input_ids=ids,
        attention_mask=mask,
        completion_mask=mask[:, P:].float(),
        group_ids=torch.arange(N),
        scores=torch.zeros(N),
        engine_logprobs=torch.zeros(N, T),
        truncated=torch.zeros(N, dtype=torch.bool),
    )


def flat(prompts, result):
    """``(prompt, generation)`` of every sample of ``engine.generate(prompts, ...)``."""
    return [(p, g) for p, row in zip(prompts, result, strict=True) for g in row]


@torch.no_grad()
def policy_logprobs(policy: Policy, prompts, result) -> list[torch.Tensor]:
    """The trainer-side log-probs (untempered) of each sampled completion, one padded forward."""
    pairs = flat(prompts, result)
    batch = rollout_of([p for p, _ in pairs], [g.token_ids for _, g in pairs], policy.tokenizer.pad_token_id)
    scores = policy.eval()(batch, 1.0).logprobs  # [N, T]
    return [scores[i, : len(g.token_ids)] for i, (_, g) in enumerate(pairs)]


def largest_gap(policy: Policy, prompts, result) -> float:
    expected = policy_logprobs(policy, prompts, result)
    return max(
        (torch.tensor(g.logprobs) - e).abs().max().item()
        for (_, g), e in zip(flat(prompts, result), expected, strict=True)
    )


def always_predicts(model, token_id: int):
    """Weights under which every position predicts ``token_id`` (logit ``hidden_size``, 256; others 0)."""
    return predicts(model, token_id)


@pytest.fixture(scope="module")
def trained(checkpoint, prompts):
    """The policy after one AdamW step (lr 1e-3) raising the log-probs of its own samples: the embeddings,
    the LM head, every projection and bias move (the export and push tests need weights unlike the build's)."""
    policy = Policy.load(str(checkpoint))
    engine = HFEngine(max_new_tokens=8)
    engine.start(str(checkpoint))
    pairs = flat(prompts, engine.generate(prompts, 2, seed=1))
    batch = rollout_of([p for p, _ in pairs], [g.token_ids for _, g in pairs], policy.tokenizer.pad_token_id)
    loss = -(policy(batch, 1.0).logprobs * batch.completion_mask).sum()
    loss.backward()
    torch.optim.AdamW(policy.parameters(), lr=1e-3).step()
    return policy.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """``trained`` written by rlkit's ExportHF callback (full_state_dict + save_pretrained) on one process."""
    directory = tmp_path_factory.mktemp("export") / "hf_export"
    trainer = SimpleNamespace(is_global_zero=True, strategy=None, logger=None, default_root_dir=str(directory.parent))
    module = PolicyGradient(GroupMean(), TokenRatio(), PPOClip(), TokenMean())  # ExportHF exports a Family's policy
    module.policy = trained
    ExportHF(str(directory)).on_fit_end(trainer, module)
    return directory


def test_chat_prompts_end_where_the_assistant_answers(tokenizer, prompts):
    head = tokenizer("<|im_start|>assistant\n")["input_ids"]
    assert len(head) == 3  # <|im_start|>, "assistant", "\n"
    for chat, ids in zip(CHATS, prompts, strict=True):
        assert ids[-3:] == head and ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert len(prompts[-1]) > 128  # the long system prompt fills a KV block


def test_hf_engine_logprobs_match_the_policy(checkpoint, prompts):
    engine = HFEngine(max_new_tokens=MAX_NEW_TOKENS)
    engine.start(str(checkpoint))
    result = engine.generate(prompts, 3, seed=0)
    assert largest_gap(Policy.load(str(checkpoint)), prompts, result) <= FP32_TOLERANCE


@pytest.mark.parametrize("stop", ["<|im_end|>", "<|endoftext|>"])
def test_hf_engine_stops_at_either_eos(checkpoint, tokenizer, prompts, stop):
    """The tokenizer's EOS is <|im_end|>; generation_config.json adds <|endoftext|>: both end a completion."""
    engine = HFEngine(max_new_tokens=MAX_NEW_TOKENS)
    engine.start(str(checkpoint))
    stop_id = tokenizer.convert_tokens_to_ids(stop)
    engine.update_weights(always_predicts(Policy.load(str(checkpoint)).model, stop_id).named_parameters())
    for _, g in flat(prompts, engine.generate(prompts, 2, seed=0)):
        assert g.token_ids == [stop_id] and g.finished and abs(g.logprobs[0]) < 1e-6


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_forward_equals_the_padded_one_with_gqa(checkpoint, prompts, attention):
    """Chat prompts of four lengths, completions of 0..12 tokens: packed log-probs, entropy and gradients
    are the padded ones (packing separates sequences by position ids; GQA shares k/v heads across q heads)."""
    engine = HFEngine(max_new_tokens=MAX_NEW_TOKENS)
    engine.start(str(checkpoint))
    pairs = flat(prompts, engine.generate(prompts, 3, seed=2))
    completions = [g.token_ids[: (5 * i) % (MAX_NEW_TOKENS + 1)] for i, (_, g) in enumerate(pairs)]
    assert {0, MAX_NEW_TOKENS} <= {len(c) for c in completions}
    results = {}
    for pack in (False, True):
        policy = Policy.load(str(checkpoint), pack=pack, attn_implementation=attention)
        batch = rollout_of([p for p, _ in pairs], completions, policy.tokenizer.pad_token_id)
        valid = batch.completion_mask.bool()  # [N, T]
        scores = policy(batch, 0.7, entropy=True)
        ((scores.logprobs + scores.entropy) * valid).sum().backward()
        results[pack] = scores, {name: p.grad for name, p in policy.model.named_parameters()}
    (padded, padded_grads), (packed, packed_grads) = results[False], results[True]
    torch.testing.assert_close(packed.logprobs[valid], padded.logprobs[valid], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(packed.entropy[valid], padded.entropy[valid], atol=2e-5, rtol=1e-5)
    for name, want in padded_grads.items():  # float rounding: measured ~1e-6 of each gradient's largest entry
        scale = want.abs().max().item()
        torch.testing.assert_close(
            packed_grads[name], want, atol=1e-5 * scale, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_export_round_trip_in_transformers(trained, exported, checkpoint):
    """ExportHF's directory loads back with plain transformers: the same tensors bit for bit, the LM head
    still its own tensor, the same tokenizer (vocabulary, special tokens, chat template) and EOS ids."""
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    want = trained.full_state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
    assert not torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    assert got["lm_head.weight"].data_ptr() != got["model.embed_tokens.weight"].data_ptr()
    assert model.generation_config.eos_token_id == trained.model.generation_config.eos_token_id
    original = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).state_dict()
    bias = "model.layers.0.self_attn.k_proj.bias"
    assert not torch.equal(original[bias], got[bias])
    tokenizer, before = AutoTokenizer.from_pretrained(exported, local_files_only=True), trained.tokenizer
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert tokenizer.get_vocab() == before.get_vocab()
    assert tokenizer.chat_template == before.chat_template
    assert (tokenizer.eos_token, tokenizer.pad_token) == (before.eos_token, before.pad_token)
    chat = CHATS[2]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == before.apply_chat_template(chat, tokenize=False)


# --- vLLM: one engine, started from the export -------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm(exported, prompts):
    """The engine, and what it sampled before any push (what it loaded from the exported directory)."""
    pytest.importorskip("vllm")
    engine = VLLMEngine(max_new_tokens=MAX_NEW_TOKENS, kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    engine.start(str(exported))
    at_start = engine.generate(prompts, 2, seed=0)
    yield engine, at_start
    engine.close()


def moved(policy: Policy, names: tuple[str, ...], seed: int) -> Policy:
    """A copy of ``policy`` whose tensors named ``names`` moved by noise of 0.3 of each tensor's spread."""
    policy = policy.frozen_copy()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if name in names:
                p.add_(0.3 * p.std() * torch.randn(p.shape, generator=generator))
    return policy


@pytest.mark.vllm
def test_vllm_loads_the_export(vllm, trained, checkpoint, prompts):
    """vLLM started from ExportHF's directory samples with the exported weights: log-probs equal the trained
    policy's, and are far from the weights the preset was built with."""
    _, at_start = vllm
    assert largest_gap(trained, prompts, at_start) <= FP32_TOLERANCE
    assert largest_gap(Policy.load(str(checkpoint)), prompts, at_start) > 1e-3


@pytest.mark.vllm
def test_vllm_greedy_agrees_with_hf_and_logprobs_with_the_policy(vllm, trained, exported, prompts):
    engine, _ = vllm
    engine.update_weights(trained.full_state_dict().items())
    hf = HFEngine(max_new_tokens=MAX_NEW_TOKENS)
    hf.start(str(exported))
    result = engine.generate(prompts, 1, seed=0, greedy=True)
    assert [g.token_ids for _, g in flat(prompts, result)] == [
        g.token_ids for _, g in flat(prompts, hf.generate(prompts, 1, seed=0, greedy=True))
    ]
    sampled = engine.generate(prompts, 3, seed=5)
    assert largest_gap(trained, prompts, sampled) <= FP32_TOLERANCE


@pytest.mark.vllm
@pytest.mark.parametrize("stop", ["<|im_end|>", "<|endoftext|>"])
def test_vllm_stops_at_either_eos(vllm, trained, tokenizer, prompts, stop):
    """vLLM stops at the tokenizer's EOS and at generation_config.json's other EOS id, as HFEngine does."""
    engine, _ = vllm
    stop_id = tokenizer.convert_tokens_to_ids(stop)
    engine.update_weights(always_predicts(trained.frozen_copy().model, stop_id).named_parameters())
    for greedy in (True, False):
        for _, g in flat(prompts, engine.generate(prompts, 2, seed=0, greedy=greedy)):
            assert g.token_ids == [stop_id] and g.finished and abs(g.logprobs[0]) < 1e-6


LAYER = "model.layers.1."
QKV = tuple(f"{LAYER}self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias"))


@pytest.mark.vllm
@pytest.mark.parametrize(
    "names",
    [
        ("lm_head.weight",),
        ("model.embed_tokens.weight",),
        QKV,
        (f"{LAYER}mlp.gate_proj.weight", f"{LAYER}mlp.up_proj.weight"),
    ],
    ids=["lm_head", "embed_tokens", "qkv_proj", "gate_up_proj"],
)
def test_vllm_partial_push_moves_only_the_named_tensors(vllm, trained, prompts, names):
    """A push of the untied head leaves the embedding alone (and the reverse); a push of one layer's q, k and
    v projections (``[256, 256]``, ``[128, 256]``, ``[128, 256]``: GQA) lands in vLLM's stacked qkv matrix, gate
    and up in its gate_up matrix. The engine's log-probs then follow the policy with exactly those moved."""
    engine, _ = vllm
    engine.update_weights(trained.full_state_dict().items())
    target = moved(trained, names, seed=len(names))
    state = target.full_state_dict()
    engine.update_weights([(name, state[name]) for name in names])
    result = engine.generate(prompts, 2, seed=3)
    assert largest_gap(target, prompts, result) <= FP32_TOLERANCE
    assert largest_gap(trained, prompts, result) > 1e-3  # the push did change the engine's weights
    if names == ("lm_head.weight",):  # a loader that tied the head to the embedding would be caught
        tied = target.frozen_copy()
        with torch.no_grad():
            tied.model.model.embed_tokens.weight.copy_(tied.model.lm_head.weight)
        assert largest_gap(tied, prompts, result) > 1e-3


@pytest.mark.vllm
def test_vllm_refuses_a_push_that_splits_a_stacked_module(vllm, trained, prompts):
    """k and v without q (or gate without up) would leave the rest of vLLM's stacked matrix uninitialised
    (measured: log-probs off by ~1, or NaN): refused before anything reaches the workers."""
    engine, _ = vllm
    engine.update_weights(trained.full_state_dict().items())
    target = moved(trained, QKV[2:], seed=0).full_state_dict()
    with pytest.raises(ValueError, match=r"self_attn\.qkv_proj also needs model\.layers\.1\.self_attn\.q_proj\.bias"):
        engine.update_weights([(name, target[name]) for name in QKV[2:]])
    with pytest.raises(ValueError, match=r"mlp\.gate_up_proj also needs model\.layers\.1\.mlp\.up_proj\.weight"):
        engine.update_weights([(f"{LAYER}mlp.gate_proj.weight", target[f"{LAYER}mlp.gate_proj.weight"])])
    assert largest_gap(trained, prompts, engine.generate(prompts, 1, seed=4)) <= FP32_TOLERANCE
