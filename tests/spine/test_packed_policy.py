"""The policy's packed forward (``model.loop.pack_sequences``): every score and gradient of the padded one."""

import pytest
import torch

from rlkit.embedded.model import build_tiny_checkpoint
from rlkit.errors import ConfigError
from rlkit.models import load_policy, load_tokenizer
from rlkit.spine.policy import Policy
from spine.helpers import random_rollout as rollout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=2)


def policy(checkpoint, pack: bool, attention: str = "sdpa") -> Policy:
    model = load_policy(checkpoint).train()
    model.config._attn_implementation = attention
    return Policy(model, load_tokenizer(checkpoint), checkpoint, chunk_rows=7, pack=pack)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_scores_and_gradients_equal_the_padded_ones(checkpoint, attention):
    batch = rollout()
    valid = batch.completion_mask.bool()  # [N, T]
    ids = torch.randint(0, 20, (*valid.shape, 3), generator=torch.Generator().manual_seed(1))  # [N, T, 3]
    options = dict(entropy=True, raw=True, sum_pi_squared=True, hidden=True, top_k=3, ids=ids)
    results = {}
    for pack in (False, True):
        model = policy(checkpoint, pack, attention)
        scores = model(batch, batch.temperature, **options)
        loss = (scores.logprobs * valid).sum() + (scores.entropy * valid).sum() + scores.hidden[valid].sum()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results[pack] = scores, grads
    (padded, padded_grads), (packed, packed_grads) = results[False], results[True]
    for name in ("logprobs", "entropy", "raw_logprobs", "sum_pi_squared", "hidden", "top_logprobs", "logprobs_at_ids"):
        want, got = getattr(padded, name)[valid], getattr(packed, name)[valid]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert torch.equal(packed.top_ids[valid], padded.top_ids[valid])
    assert (packed.logprobs[~valid] == packed.logprobs[~valid][0]).all()  # padding: the same constant, masked later
    for name, want in padded_grads.items():  # float rounding: ~3e-7 of each gradient's largest entry
        scale = want.abs().max().item()
        torch.testing.assert_close(
            packed_grads[name], want, atol=1e-5 * scale, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_a_model_that_lets_packed_sequences_see_each_other_is_a_config_error(checkpoint, monkeypatch):
    """transformers keeps packed sequences apart only when it finds them in the position ids; a model whose
    attention does not (here: the detection switched off) would train on cross-sequence attention."""
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    model = policy(checkpoint, pack=True)
    with pytest.raises(ConfigError, match="pack_sequences=false"):
        model(rollout(seed=3), 1.0)


@pytest.mark.parametrize("first_rows", [1, 3])
def test_the_packing_check_runs_once_whatever_the_first_batch(checkpoint, monkeypatch, first_rows):
    """Once, at the first packed forward, with the same two extra forwards whether that batch has one row
    (checked twice over: the second copy must not see the first) or more: data-parallel ranks whose first
    micro-batches differ in rows still run the same forwards (each one collective under FSDP)."""
    model = policy(checkpoint, pack=True)
    forwards = []
    model.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    batch = rollout(seed=4)
    model(batch.select(torch.arange(first_rows)), 1.0)
    assert len(forwards) == 3 and model._packing_checked  # packed + padded check, then the forward itself
    model(batch, 1.0)
    assert len(forwards) == 4


def test_one_row_sent_twice_still_catches_attention_across_sequences(checkpoint, monkeypatch):
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    model = policy(checkpoint, pack=True)
    with pytest.raises(ConfigError, match="pack_sequences=false"):
        model(rollout(seed=3).select(torch.tensor([1])), 1.0)


def test_attn_implementation_is_set_or_a_config_error(checkpoint):
    assert Policy.load(str(checkpoint), attn_implementation="eager").attn_implementation == "eager"
    with pytest.raises(ConfigError, match="model.policy.attn_implementation=bogus"):
        Policy.load(str(checkpoint), attn_implementation="bogus")
