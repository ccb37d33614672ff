"""Supervised warm-up of the embedded model, stopped by its measured held-out greedy accuracy.

Pure RL from random weights does not learn the embedded task; a supervised stage first teaches part of
it. How far matters: too little leaves RL nothing to reinforce, too much leaves it nothing to learn. The
supervised curve has a sharp phase transition (greedy accuracy 0.1 -> 0.7 within a few hundred steps)
whose position moves with the seed and with float rounding on another machine, so a fixed step count
lands anywhere on it. The warm-up therefore checks held-out greedy accuracy every few steps and stops at
the first check that reaches the target.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from rlkit.data.prompts import Prompt, PromptSource


def supervised_target(prompt: Prompt) -> str:
    """What the warm-up teaches a prompt to complete: its worked solution (``meta["solution"]``) if the
    task writes one, else its ground truth."""
    target = prompt.meta.get("solution", prompt.ground_truth)
    if target is None:
        raise ValueError(f"prompt {prompt.prompt!r} has neither a ground truth nor a worked solution to learn")
    return target


def supervised_batch(prompts: list[Prompt], tokenizer) -> tuple[Tensor, Tensor]:
    """Tokenise ``prompt + target + eos`` (see :func:`supervised_target`), loss on the target only.

    The prompt is tokenised exactly as rollouts tokenise it (``tokenizer(text)``, special tokens such as
    BOS included), so warm-up and RL see the same prefixes.

    Returns:
        ``(input_ids [M, L], labels [M, L])``, right-padded with the pad token; ``labels`` is ``-100``
        on the prompt and the padding (the ``CrossEntropyLoss`` ignore index).
    """
    prompt_ids = tokenizer([p.prompt for p in prompts])["input_ids"]
    target_ids = tokenizer([supervised_target(p) for p in prompts], add_special_tokens=False)["input_ids"]
    rows = [q + a + [tokenizer.eos_token_id] for q, a in zip(prompt_ids, target_ids, strict=True)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # [M, L]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [M, L]
    for i, (row, prompt) in enumerate(zip(rows, prompt_ids, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(prompt) : len(row)] = torch.tensor(row[len(prompt) :])
    return input_ids, labels


@torch.no_grad()
def greedy_exact_match(model, input_ids: Tensor, labels: Tensor, chunk_rows: int = 256) -> Tensor:
    """``[M]`` bool: whether greedy decoding from each prompt writes exactly its target and EOS.

    Greedy decoding reproduces a target iff the most likely next token is the target's at every target
    position given the target's own prefix, so one teacher-forced forward pass measures it; no decoding
    loop. (A greedy completion that differs from the worked solution but ends in the right result counts
    as a miss here and as correct under ``FinalAnswer``: this is a lower bound of that accuracy.)

    Args:
        model: a causal LM.
        input_ids: ``[M, L]`` from :func:`supervised_batch`.
        labels: ``[M, L]`` from :func:`supervised_batch`.
        chunk_rows: rows per forward pass.
    """
    hits = []
    for ids, lab in zip(input_ids.split(chunk_rows), labels.split(chunk_rows), strict=True):
        predicted = model(input_ids=ids).logits[:, :-1].argmax(dim=-1)  # [m, L-1]: position t predicts t+1
        targets = lab[:, 1:]  # [m, L-1]
        hits.append(((predicted == targets) | (targets == -100)).all(dim=-1))  # [m]
    return torch.cat(hits)


def warm_up(
    model,
    tokenizer,
    train: PromptSource,
    held_out: PromptSource,
    *,
    target_accuracy: float,
    max_steps: int,
    check_every: int,
    batch_size: int,
    lr: float,
    seed: int,
    encode: Callable[[list[Prompt], object], tuple[Tensor, Tensor]] = supervised_batch,
) -> dict:
    """Supervised AdamW steps on ``train`` until greedy accuracy on ``held_out`` reaches ``target_accuracy``.

    Each step takes ``batch_size`` rows of ``train`` drawn by a generator seeded with ``seed`` (the global
    RNG is untouched). Every ``check_every`` steps :func:`greedy_exact_match` scores ``held_out``; the
    first check at or above the target ends the warm-up. If ``max_steps`` pass first, it warns and keeps
    the last weights. ``encode`` makes the rows and their labels (:func:`supervised_batch`; the multi-turn
    task's worked episodes: :func:`rlkit.embedded.turns.transcript_batch`).

    Returns:
        ``{"steps": ..., "accuracy": ..., "checks": [[step, accuracy], ...]}`` (accuracy on ``held_out``).
    """
    train_ids, train_labels = encode([train[i] for i in range(len(train))], tokenizer)  # [S, L]
    held_ids, held_labels = encode([held_out[i] for i in range(len(held_out))], tokenizer)  # [H, L']
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    checks: list[list[float]] = []
    accuracy, step = 0.0, 0
    model.train()
    while step < max_steps:
        rows = torch.randint(len(train_ids), (batch_size,), generator=generator)  # [batch]
        ids, labels = train_ids[rows], train_labels[rows]  # [batch, L]
        width = int((labels != -100).nonzero()[:, 1].max()) + 1  # drop columns that are padding in every row
        loss = model(input_ids=ids[:, :width], labels=labels[:, :width]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step % check_every == 0 or step == max_steps:
            model.eval()
            accuracy = greedy_exact_match(model, held_ids, held_labels).float().mean().item()
            model.train()
            checks.append([step, round(accuracy, 4)])
            if accuracy >= target_accuracy:
                break
    model.eval()
    if accuracy < target_accuracy and max_steps > 0:
        warnings.warn(
            f"the warm-up reached held-out greedy accuracy {accuracy:.3f} after {step} steps, short of its "
            f"target {target_accuracy}; RL starts lower than intended (raise max_steps or the learning rate)",
            stacklevel=2,
        )
    return {"steps": step, "accuracy": accuracy, "checks": checks}
