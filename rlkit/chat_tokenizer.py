"""A Qwen2-style chat tokenizer trained here: byte-level BPE, Qwen2's special tokens, a ChatML template.

Nothing is downloaded: :func:`training_corpus` writes a deterministic text (worked arithmetic, word problems
with ``\\boxed{}`` answers, English-like sentences, Python snippets, chat turns and tool calls), and
:func:`train_chat_tokenizer` trains a byte-level BPE on it with the ``tokenizers`` library. The pipeline is
the one ``transformers`` rebuilds for ``Qwen2Tokenizer`` (NFC, Qwen2's split regex, byte-level, single
digits), so a checkpoint of model type ``qwen2``, for which transformers 5.x forces that class, tokenises
exactly as the trained tokenizer does. Special tokens follow the BPE vocabulary, as in Qwen2.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

#: Qwen2's pre-tokenizer split (the pattern transformers' ``Qwen2Tokenizer`` uses): contractions, words
#: with one leading non-letter, single digits, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: Control tokens (``special``: dropped by ``decode(..., skip_special_tokens=True)``), in id order after the BPE.
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Markup tokens of tool calls and reasoning (Qwen2.5 / Qwen3): single tokens, kept when decoding.
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
#: End of an assistant turn (the tokenizer's EOS) and end of a document (pad; also a stop token).
EOS, PAD = "<|im_end|>", "<|endoftext|>"

#: ChatML as Qwen2.5 writes it: ``<|im_start|>{role}\n{content}<|im_end|>\n``; with ``tools`` a system
#: turn lists their JSON schemas in ``<tools>``; an assistant's ``tool_calls`` become ``<tool_call>`` JSON;
#: consecutive ``tool`` messages go in one user turn, each in ``<tool_response>``. No default system turn.
CHAT_TEMPLATE = r"""
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system is not none %}{{- system + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": ' }}
    {{- '<args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif system is not none %}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- elif not (loop.first and system is not none) %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content if message.content is string else '') }}
        {%- for call in (message.tool_calls or []) if message.role == 'assistant' %}
            {%- set call = call.function if call.function is defined else call %}
            {%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

_NAMES = "Ada Bo Cleo Dev Emi Finn Gia Hal Ivy Jun Kai Lena Milo Nia Omar Pia Quinn Ravi Sara Theo Uma Wren Zed"
_NOUNS = (
    "apple book river stone garden window teacher child city train letter song market bridge forest dog cat "
    "bird table road cloud lamp ship farmer doctor baker island mountain clock friend house school field"
)
_PLURALS = "apples books pencils marbles cookies coins stamps shells cards eggs oranges boxes tickets flowers"
_VERBS = "sees finds carries reads paints builds follows opens watches likes draws visits moves cleans"
_ADJECTIVES = "small red quiet old bright green tall happy cold warm heavy new wooden busy gentle round"
_PLACES = "near the river|in the garden|under the bridge|at the market|on the hill|by the window|after school"
#: Syllables of made-up words: the corpus's open vocabulary, so the BPE has thousands of words to merge.
_SYLLABLES = (
    "ka lo mi ne ru sa te vo zi bar den fel gor han jul kor lim mon pas ril sen tor vin wex "
    "ba ce di fo gu hi ja ko lu ma no pe qui ra so tu va we xi yo zu ash bel cor dun eth fim"
)
_FUNCTIONS = "add total count scale merge clip mean score parse split shift mask"
_VARIABLES = "x y n items values total count result index left right key"


def _words(text: str) -> list[str]:
    return text.split("|") if "|" in text else text.split()


def _arithmetic(rng: random.Random) -> str:
    terms = [rng.randint(0, rng.choice((9, 20, 99))) for _ in range(rng.randint(2, 4))]
    total, steps = terms[0], []
    for term in terms[1:]:
        steps.append(f"{total}+{term}={total + term}")
        total += term
    a, b = rng.randint(2, 99), rng.randint(2, 12)
    return rng.choice(
        (
            "+".join(map(str, terms)) + "=" + ",".join(steps),
            f"{a}*{b}={a * b}",
            f"{a * b}/{b}={a}",
            f"{a + b}-{b}={a}",
            f"What is {a} times {b}? The answer is \\boxed{{{a * b}}}.",
        )
    )


def _word_problem(rng: random.Random) -> str:
    name, other = rng.sample(_words(_NAMES), 2)
    thing = rng.choice(_words(_PLURALS))
    a, b = rng.randint(2, 60), rng.randint(2, 30)
    return (
        f"{name} has {a} {thing}. {other} gives {name} {b} more. How many {thing} does {name} have now?\n"
        f"<think>\n{name} starts with {a} {thing} and gets {b} more, so {a}+{b}={a + b}.\n</think>\n"
        f"{name} has {a + b} {thing}. The final answer is \\boxed{{{a + b}}}.\n#### {a + b}"
    )


def _made_up(rng: random.Random) -> str:
    return "".join(rng.choice(_words(_SYLLABLES)) for _ in range(rng.randint(2, 3)))


def _glossary(rng: random.Random) -> str:
    word, other, third = _made_up(rng), _made_up(rng), _made_up(rng)
    return (
        f"In the old tales of {other.capitalize()}, a {word} is a {rng.choice(_words(_ADJECTIVES))} "
        f"{rng.choice(_words(_NOUNS))} that {rng.choice(_words(_VERBS))} every {third} "
        f"{rng.choice(_words(_PLACES))}. The {word}s of {other.capitalize()} are {_made_up(rng)}."
    )


def _sentence(rng: random.Random) -> str:
    made_up = _made_up(rng)
    subject = rng.choice((rng.choice(_words(_NAMES)), f"The {rng.choice(_words(_NOUNS))}", made_up.capitalize()))
    sentence = (
        f"{subject} {rng.choice(_words(_VERBS))} the {rng.choice(_words(_ADJECTIVES))} "
        f"{rng.choice(_words(_NOUNS))} {rng.choice(_words(_PLACES))}"
    )
    return sentence + rng.choice((".", "!", "?", ", and it's fine.", "; they don't mind."))


def _python(rng: random.Random) -> str:
    name, variable, other = rng.choice(_words(_FUNCTIONS)), *rng.sample(_words(_VARIABLES), 2)
    k = rng.randint(0, 9)
    return rng.choice(
        (
            f"def {name}({variable}, {other}):\n    return {variable} + {other} * {k}\n",
            f"def {name}({variable}):\n    {other} = 0\n    for v in {variable}:\n        {other} += v\n"
            f"    return {other}\n",
            f'if {variable} > {k}:\n    print("{name}", {variable})\nelse:\n    {variable} = [{k}, {k + 1}]\n',
            f"{other} = {{'{variable}': {k}, '{name}': [{k}, {k * 2}]}}\nassert len({other}) == 2\n",
        )
    )


def _chat(rng: random.Random) -> str:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    question = rng.choice((f"What is {a}+{b}?", _sentence(rng), f"Compute {a}+{b} step by step."))
    call = json.dumps({"name": rng.choice(_words(_FUNCTIONS)), "arguments": {"a": a, "b": b}})
    answer = rng.choice((f"{a}+{b}={a + b}", _sentence(rng), f"<tool_call>\n{call}\n</tool_call>"))
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" if rng.random() < 0.3 else ""
    return f"{system}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


_KINDS = (_arithmetic, _word_problem, _sentence, _python, _chat, _glossary)


def training_corpus(num_documents: int = 20000, seed: int = 0) -> Iterator[str]:
    """``num_documents`` short documents of six kinds in turn, drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    for i in range(num_documents):
        yield _KINDS[i % len(_KINDS)](rng)


def train_chat_tokenizer(vocab_size: int = 8192, num_documents: int = 20000, seed: int = 0):
    """A ``Qwen2Tokenizer`` whose byte-level BPE is trained on :func:`training_corpus`.

    Ids: the 256 byte tokens, the merges (at most ``vocab_size`` tokens so far: the corpus may support
    fewer), then :data:`CONTROL_TOKENS` and :data:`MARKUP_TOKENS`. EOS is ``<|im_end|>``, pad
    ``<|endoftext|>``; no BOS (Qwen2 has none). Deterministic for a given ``seed``.

    Args:
        vocab_size: most tokens of the BPE before the special tokens (bytes and merges).
        num_documents: size of the training corpus.
        seed: seed of the corpus.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    if vocab_size <= 256:
        raise ValueError(f"vocab_size must exceed the 256 byte tokens, got {vocab_size}")
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(training_corpus(num_documents, seed), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token=None,  # set below, once the special tokens hold their ids in order
        pad_token=None,
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tokenizer.eos_token, tokenizer.pad_token = EOS, PAD
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
