"""The frozen teacher of on-policy distillation: loaded from a local checkpoint, checked against the student.

The teacher scores the student's tokens by id, so both must share one tokenizer: the same token -> id
map and the same output width. Anything else is refused before training starts, naming both checkpoints.
"""

from __future__ import annotations

from rlkit.algorithms.policy import Policy
from rlkit.errors import ConfigError


#: held-out greedy accuracy (worked solutions written exactly) at which the embedded teacher's warm-up stops
TEACHER_ACCURACY = 0.75


def embedded_teacher() -> str:
    """rlkit's embedded teacher: a wider model than the embedded student (hidden 128, 4 heads), warmed up on
    the same task until its held-out greedy accuracy reaches 0.75 (the student stops at 0.2; about 1000
    steps, 1.5 min on one core), and cached like it (see :func:`rlkit.models.embedded_checkpoint`)."""
    from rlkit.models import embedded_checkpoint

    return str(embedded_checkpoint(target_accuracy=TEACHER_ACCURACY, hidden_size=128, num_heads=4))


def load_teacher(checkpoint: str | None, student: Policy, *, trust_remote_code: bool = False) -> Policy:
    """The teacher at ``checkpoint`` (None: :func:`embedded_teacher`), frozen, checked against ``student``."""
    directory = embedded_teacher() if checkpoint is None else checkpoint
    teacher = Policy.load(
        directory,
        trust_remote_code=trust_remote_code,
        chunk_rows=student.chunk_rows,
        pack=student.pack,
        attn_implementation=student.attn_implementation,
    )
    check_same_vocabulary(student, teacher)
    return teacher.eval().requires_grad_(False)


def check_same_vocabulary(student: Policy, teacher: Policy) -> None:
    """Raise a one-line :class:`ConfigError` naming both checkpoints if the vocabularies differ."""
    student_vocab, teacher_vocab = student.tokenizer.get_vocab(), teacher.tokenizer.get_vocab()
    problem = None
    if len(student_vocab) != len(teacher_vocab):
        problem = f"{len(student_vocab)} tokens in the student's tokenizer, {len(teacher_vocab)} in the teacher's"
    elif student_vocab != teacher_vocab:
        token = next(t for t in sorted(student_vocab) if teacher_vocab.get(t) != student_vocab[t])
        problem = (
            f"token {token!r} has id {student_vocab[token]} for the student, {teacher_vocab.get(token)} for the teacher"
        )
    elif student.vocabulary_size != teacher.vocabulary_size:
        problem = f"output widths differ ({student.vocabulary_size} vs {teacher.vocabulary_size} logits)"
    if problem is not None:
        raise ConfigError(
            f"model.teacher {teacher.checkpoint_dir} and the student {student.checkpoint_dir} have different "
            f"vocabularies ({problem}); the teacher scores the student's tokens by id, so choose a teacher "
            "that shares the student's tokenizer"
        )
