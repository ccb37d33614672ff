"""Weights under which a model's next-token distribution is known in closed form (shared by the engine tests)."""

import torch


def predicts(model, token_id: int, head: float = 1.0):
    """``model`` (changed in place and returned) with zero ``o_proj``/``down_proj``, so the residual stream is
    the token embedding; all-ones embeddings and norm weights, so the last hidden state is all ones (RMS of ones
    is 1); and an LM head whose only non-zero row is ``token_id``'s, all ``head``: at every position ``token_id``
    has logit ``head * hidden_size`` and every other token 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")):
                p.zero_()
            elif name.endswith(("embed_tokens.weight", "norm.weight")):
                p.fill_(1.0)
        model.lm_head.weight[token_id] = head
    return model
