"""The frozen teacher of on-policy distillation: loaded from a local checkpoint, checked against the student.

The teacher scores the student's tokens by id, so both must share one tokenizer: the same token -> id
map and the same output width. Anything else is refused before training starts, naming both checkpoints.
"""

from __future__ import annotations

from rlkit.errors import ConfigError
from rlkit.models import ModelSource
from rlkit.spine.policy import Policy


def load_teacher(checkpoint: ModelSource | str | None, student: Policy, *, trust_remote_code: bool = False) -> Policy:
    """The teacher at ``checkpoint`` (a directory or a model source), frozen, checked against ``student``."""
    teacher = Policy.load(
        checkpoint,
        trust_remote_code=trust_remote_code,
        chunk_rows=student.chunk_rows,
        pack=student.pack,
        attn_implementation=student.attn_implementation,
        option="model.teacher",
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
