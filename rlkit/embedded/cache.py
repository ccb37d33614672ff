"""The embedded checkpoints: the tiny model after its supervised warm-up, built once and cached.

:class:`EmbeddedModel` and :class:`EmbeddedTeacher` are :class:`~rlkit.models.ModelSource` s: a config names
one where it would name a checkpoint directory (``model.init_args.policy.checkpoint``,
``model.init_args.teacher``), and the directory is built on first use. Model loading never imports this
package; only a config that names the demo does.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from rlkit.embedded.model import build_tiny_checkpoint
from rlkit.models import ModelSource, default_cache_dir, load_policy, load_tokenizer

_PACKAGE = Path(__file__).resolve().parents[1]  # rlkit/


def _code_files() -> list[Path]:
    """The rlkit modules whose code decides what the warm-up produces: every file of this package and,
    transitively, every rlkit module they import (read from their import statements, not listed by hand)."""
    seen: dict[str, Path] = {}
    pending = [f"rlkit.embedded.{p.stem}" for p in sorted(Path(__file__).parent.glob("*.py"))]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        path = _PACKAGE.parent / (name.replace(".", "/") + ".py")
        if not path.is_file():
            path = path.with_suffix("") / "__init__.py"
        if not path.is_file():
            continue
        seen[name] = path
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlkit"):
                pending.append(node.module)
            elif isinstance(node, ast.Import):
                pending.extend(alias.name for alias in node.names if alias.name.startswith("rlkit"))
    return [seen[name] for name in sorted(seen)]


def _warm_up_code_digest() -> str:
    """sha256 of the warm-up's code (see :func:`_code_files`) and of the libraries' versions that run it."""
    import transformers

    digest = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    for path in _code_files():
        digest.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def embedded_checkpoint(
    cache_dir: str | os.PathLike | None = None,
    *,
    target_accuracy: float = 0.2,
    max_sft_steps: int = 3000,
    check_every: int = 10,
    sft_batch_size: int = 32,
    sft_lr: float = 2e-3,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
    episodes: bool = False,
) -> Path:
    """The tiny model after a supervised warm-up on :class:`~rlkit.embedded.chain.AdditionChain`.

    Pure RL from random weights does not learn the task; a supervised stage (worked solution + EOS,
    cross-entropy on the completion only) runs until greedy accuracy on the held-out questions the
    experiments validate on (512 distinct test-split questions, seed 0) reaches ``target_accuracy``, checked
    every ``check_every`` steps (see :mod:`rlkit.embedded.warmup`), which leaves RL clear room. The result is cached
    in ``cache_dir / embedded-<key>``, the key hashing every setting, the warm-up's code and the
    torch/transformers versions, so a change to any of them builds a new checkpoint. It is written
    atomically (built in a temporary directory, then renamed), so a killed run never leaves a half
    checkpoint; later calls return the cached directory at once. Deterministic on one machine for a given
    ``seed``; across machines float rounding may move the stopping step, not the stopping accuracy.
    ``rlkit_embedded.json`` in the directory records the settings, steps and held-out accuracy reached.

    Args:
        cache_dir: cache root; default ``$RLKIT_CACHE`` or ``~/.cache/rlkit``.
        target_accuracy: stop the warm-up at the first check with held-out greedy accuracy at or above this.
        max_sft_steps: give up (with a warning) after this many supervised steps; 0 keeps the random weights.
        check_every: supervised steps between held-out checks.
        sft_batch_size: questions per supervised step.
        sft_lr: AdamW learning rate of the warm-up.
        hidden_size: see :func:`build_tiny_checkpoint`.
        num_layers: see :func:`build_tiny_checkpoint`.
        num_heads: see :func:`build_tiny_checkpoint`.
        head_dim: see :func:`build_tiny_checkpoint`.
        seed: seed of the initialisation and the warm-up batches.
        episodes: warm up on the multi-turn task's worked episodes instead
            (:class:`~rlkit.embedded.turns.RevealedChain` with :func:`~rlkit.embedded.turns.transcript_batch`,
            held out on its 512 test-split questions), cached apart as ``embedded-turns-<key>``.
    """
    if max_sft_steps < 0:
        raise ValueError(f"max_sft_steps must be >= 0, got {max_sft_steps}")
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every}")
    settings = {
        "target_accuracy": target_accuracy,
        "max_sft_steps": max_sft_steps,
        "check_every": check_every,
        "sft_batch_size": sft_batch_size,
        "sft_lr": sft_lr,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "head_dim": head_dim,
        "seed": seed,
    }
    if episodes:  # only then, so the single-turn model's settings (and key) read as before
        settings["episodes"] = True
    code = _warm_up_code_digest()
    key = hashlib.sha256((json.dumps(settings, sort_keys=True) + code).encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"embedded-{'turns-' if episodes else ''}{key}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".embedded-{key}-", dir=root))
    # built in float32 on the CPU whatever the caller's defaults: Lightning's 64-true precision makes float64 the
    # default while a model loads (a float64 warm-up would cache another checkpoint under the same key), and on a
    # GPU Lightning's configure_model runs under a CUDA default device (the warm-up's CPU generator then failed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            build_tiny_checkpoint(
                staging,
                hidden_size=hidden_size,
                num_layers=num_layers,
                num_heads=num_heads,
                head_dim=head_dim,
                seed=seed,
            )
            record = {"settings": settings, "code_sha256": code}
            if max_sft_steps:
                model = load_policy(staging)
                record["warm_up"] = _warm_up(model, load_tokenizer(staging), settings)
                model.save_pretrained(staging)
        (staging / "rlkit_embedded.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep its copy
            if not (target / "config.json").exists():
                raise
    finally:
        torch.set_default_dtype(previous)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _warm_up(model, tokenizer, settings: dict) -> dict:
    """The embedded warm-up: AdditionChain's train split (or RevealedChain's worked episodes), stopped on the
    experiments' held-out set."""
    from rlkit.embedded.chain import AdditionChain
    from rlkit.embedded.turns import RevealedChain, transcript_batch
    from rlkit.embedded.warmup import supervised_batch, warm_up

    steps, batch_size = settings["max_sft_steps"], settings["sft_batch_size"]
    source, encode = (
        (RevealedChain, transcript_batch) if settings.get("episodes") else (AdditionChain, supervised_batch)
    )
    # Enough distinct draws that no row is seen more than a few times, capped to keep tokenising quick.
    train = source(num_prompts=min(steps * batch_size, 32768), seed=settings["seed"], split="train")
    held_out = source(num_prompts=512, seed=0, split="test", unique=True)
    return warm_up(
        model,
        tokenizer,
        train,
        held_out,
        target_accuracy=settings["target_accuracy"],
        max_steps=steps,
        check_every=settings["check_every"],
        batch_size=batch_size,
        lr=settings["sft_lr"],
        seed=settings["seed"],
        encode=encode,
    )


class EmbeddedModel(ModelSource):
    """rlkit's embedded policy: the tiny Llama warmed up on chained addition until its held-out greedy
    accuracy reaches ``target_accuracy`` (see :func:`embedded_checkpoint`, whose settings these are).

    Args:
        target_accuracy: stop the warm-up at the first check with held-out greedy accuracy at or above this.
        hidden_size: model width.
        num_heads: attention heads.
        seed: seed of the initialisation and the warm-up batches.
    """

    def __init__(self, target_accuracy: float = 0.2, hidden_size: int = 64, num_heads: int = 2, seed: int = 0):
        self.target_accuracy = target_accuracy
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.seed = seed

    def directory(self) -> Path:
        return embedded_checkpoint(
            target_accuracy=self.target_accuracy, hidden_size=self.hidden_size, num_heads=self.num_heads, seed=self.seed
        )

    def describe(self) -> str:
        return "embedded" if vars(self) == vars(EmbeddedModel()) else f"embedded{vars(self)}"


class EmbeddedTeacher(EmbeddedModel):
    """The embedded teacher of on-policy distillation: a wider model (hidden 128, 4 heads) than the student,
    warmed up further, to 0.75 held-out greedy accuracy (about 1000 steps, 1.5 min on one core).

    Args:
        target_accuracy: stop the warm-up at the first check with held-out greedy accuracy at or above this.
        hidden_size: model width.
        num_heads: attention heads.
        seed: seed of the initialisation and the warm-up batches.
    """

    def __init__(self, target_accuracy: float = 0.75, hidden_size: int = 128, num_heads: int = 4, seed: int = 0):
        super().__init__(target_accuracy, hidden_size, num_heads, seed)

    def describe(self) -> str:
        return "embedded-teacher" if vars(self) == vars(EmbeddedTeacher()) else f"embedded-teacher{vars(self)}"


class EmbeddedEpisodeModel(EmbeddedModel):
    """The embedded policy of the multi-turn task (:mod:`rlkit.embedded.turns`): the same tiny Llama, warmed
    up on worked episodes of :class:`~rlkit.embedded.turns.RevealedChain` until its held-out greedy episode
    accuracy reaches ``target_accuracy`` (``embedded_checkpoint(episodes=True)``, cached apart from the
    single-turn model, which is unchanged).

    Args:
        target_accuracy: stop the warm-up at the first check with held-out greedy accuracy at or above this.
        hidden_size: model width.
        num_heads: attention heads.
        seed: seed of the initialisation and the warm-up batches.
    """

    def directory(self) -> Path:
        return embedded_checkpoint(
            target_accuracy=self.target_accuracy,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            seed=self.seed,
            episodes=True,
        )

    def describe(self) -> str:
        return "embedded-turns" if vars(self) == vars(EmbeddedEpisodeModel()) else f"embedded-turns{vars(self)}"
