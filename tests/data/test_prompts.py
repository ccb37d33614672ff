"""PromptFile (TRL and verl layouts, JSONL/JSON/parquet, every error path) and encode_prompt."""

import json
import logging
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from spine.helpers import EXPERIMENTS
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import BatchEncoding, PreTrainedTokenizerFast

from rlkit.cli import main
from rlkit.data.prompts import Prompt, PromptFile, PromptSource, encode_prompt
from rlkit.errors import ConfigError

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]
VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": CHAT,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "what is 3+3?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "6"},
        "extra_info": {"split": "train", "index": 1},
    },
]
TRL_ROWS = [{"prompt": "what is 2+2?"}, {"prompt": [{"role": "user", "content": "hi"}]}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", ["jsonl", "json", "parquet"])
def test_verl_layout_round_trips(tmp_path, suffix):
    path = tmp_path / f"p.{suffix}"
    if suffix == "jsonl":
        write_jsonl(path, VERL_ROWS)
    elif suffix == "json":
        path.write_text(json.dumps(VERL_ROWS))
    else:
        write_parquet(path, VERL_ROWS)
    source = PromptFile(str(path))
    assert isinstance(source, PromptSource)
    assert len(source) == 2 and source.layout == "verl"
    assert source[0] == Prompt(
        prompt=CHAT,
        ground_truth="4",
        meta={
            "data_source": "openai/gsm8k",
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "extra_info": {"split": "train", "index": 0},
        },
    )
    assert source[1].prompt == [{"role": "user", "content": "what is 3+3?"}]
    assert source[1].ground_truth == "6"


def test_trl_layout_jsonl_and_parquet(tmp_path):
    rows = [{"prompt": "what is 2+2?", "id": 7}, {"prompt": "what is 3+3?", "id": 8}]
    for path in (write_jsonl(tmp_path / "t.jsonl", rows), write_parquet(tmp_path / "t.parquet", rows)):
        source = PromptFile(str(path))
        assert source.layout == "trl"
        assert [p.prompt for p in source] == ["what is 2+2?", "what is 3+3?"]
        assert [p.ground_truth for p in source] == [None, None]
        assert [p.meta for p in source] == [{"id": 7}, {"id": 8}]


def test_trl_conversational_prompts_in_parquet_drop_null_struct_fields(tmp_path):
    # parquet unifies struct fields across rows: a message without "name" reads back with name=None
    rows = [
        {"prompt": [{"role": "user", "content": "hi", "name": "ann"}]},
        {"prompt": [{"role": "user", "content": "yo"}]},
    ]
    source = PromptFile(str(write_parquet(tmp_path / "c.parquet", rows)))
    assert source[0].prompt == [{"role": "user", "content": "hi", "name": "ann"}]
    assert source[1].prompt == [{"role": "user", "content": "yo"}]


def test_dotted_keys_nested_and_literal(tmp_path):
    rows = [{"q": {"text": "2+2?"}, "a": {"final": 4}}]
    source = PromptFile(str(write_jsonl(tmp_path / "d.jsonl", rows)), prompt_key="q.text", answer_key="a.final")
    assert source[0].prompt == "2+2?"
    assert source[0].ground_truth == "4"  # numbers become strings
    assert source[0].meta == {"a": {"final": 4}}  # the prompt's column is dropped, the rest kept
    # a flattened column literally named "reward_model.ground_truth" is read first
    flat = [{"prompt": "x", "reward_model.ground_truth": "5"}]
    assert PromptFile(str(write_parquet(tmp_path / "f.parquet", flat)))[0].ground_truth == "5"
    # a column literally named "q.text" is the prompt, and an unrelated column "q" stays in meta
    both = [{"q.text": "lit", "q": {"text": "nested"}}]
    source = PromptFile(str(write_jsonl(tmp_path / "l.jsonl", both)), prompt_key="q.text")
    assert source[0].prompt == "lit" and source[0].meta == {"q": {"text": "nested"}}


def test_top_level_answer_column_and_limit(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(5)]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    source = PromptFile(str(path), prompt_key="question", answer_key="answer", limit=3)
    assert len(source) == 3
    # the answer column stays in meta too: TRL reward functions take it by name
    expected = [(f"q{i}", str(i), {"answer": str(i)}) for i in range(3)]
    assert [(p.prompt, p.ground_truth, p.meta) for p in source] == expected
    assert len(PromptFile(str(write_parquet(tmp_path / "a.parquet", rows)), "question", "answer", limit=2)) == 2


def test_blank_jsonl_lines_are_skipped(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text('{"prompt": "a"}\n\n   \n{"prompt": "b"}\n')
    assert [p.prompt for p in PromptFile(str(path))] == ["a", "b"]


def test_hint_when_trl_file_has_an_answer_column(tmp_path):
    path = write_jsonl(tmp_path / "h.jsonl", [{"prompt": "q", "solution": "4"}])
    with pytest.warns(UserWarning, match=r"column\(s\) \['solution'\]: set answer_key"):
        PromptFile(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PromptFile(str(write_jsonl(tmp_path / "n.jsonl", [{"prompt": "q"}])))  # no hint, no warning


# --- errors: each names the file, the line or row, and the fix -------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl' not found.*Check `path`"):
        PromptFile(str(tmp_path / "nope.jsonl"))


def test_unknown_suffix(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"p\.csv: unknown file type '\.csv'\. Use \.jsonl .*\.json .*\.parquet"):
        PromptFile(str(path))


def test_malformed_json_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"m\.jsonl, line 2: malformed JSON .*one complete JSON object"):
        PromptFile(str(path))


def test_malformed_json_file_and_wrong_top_level(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(ValueError, match=r"m\.json, line 2: malformed JSON"):
        PromptFile(str(bad))
    obj = tmp_path / "o.json"
    obj.write_text('{"prompt": "a"}')
    with pytest.raises(ValueError, match=r"must hold a list of objects, got dict.*\.jsonl"):
        PromptFile(str(obj))
    scalar = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a"}, 3])
    with pytest.raises(ValueError, match=r"s\.jsonl, line 2: expected a JSON object, got int"):
        PromptFile(str(scalar))


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_a_prompt_file_that_is_not_utf8_is_named_with_its_line_and_byte_offset(tmp_path, suffix):
    path = tmp_path / f"latin1.{suffix}"
    rows = ['{"prompt": "caf\u00e9"}', '{"prompt": "na\xefve"}']  # row 1 UTF-8; row 2 written as Latin-1
    if suffix == "jsonl":
        first, end = rows[0].encode() + b"\n", b"\n"
    else:  # one JSON list over two lines
        first, end = b"[" + rows[0].encode() + b",\n", b"]"
    path.write_bytes(first + rows[1].encode("latin-1") + end)
    offset = len(first) + len('{"prompt": "na')
    with pytest.raises(ConfigError) as error:
        PromptFile(str(path))
    assert str(error.value).startswith(
        f"{path}, line 2: not UTF-8 text (byte 0xef at byte offset {offset} of the file, byte 15 of the line)."
    )


def test_a_prompt_file_that_is_not_utf8_stops_fit_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(logging, "raiseExceptions", False)  # see tests/spine/test_cli_errors.py
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                f"--config={EXPERIMENTS / 'drgrpo.yaml'}",
                "--data.prompts=PromptFile",
                f"--data.prompts.path={path}",
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "Traceback" not in "".join(err)
    assert err[-1].startswith(f"rlkit: error: {path}, line 2: not UTF-8 text (byte 0xe9 at byte offset 31 of the file")


def test_row_without_prompt_key_lists_its_keys(tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [{"prompt": "a"}, {"question": "b", "answer": "1"}])
    with pytest.raises(ValueError, match=r"k\.jsonl, line 2: no prompt key 'prompt'; the row has keys "
                       r"\['answer', 'question'\]\. Set prompt_key"):  # fmt: skip
        PromptFile(str(path))
    pq_path = write_parquet(tmp_path / "k.parquet", [{"question": "b"}])
    with pytest.raises(ValueError, match=r"k\.parquet, row 0 \(from 0\): no prompt key 'prompt'"):
        PromptFile(str(pq_path))


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (3, r"the prompt must be a string or a non-empty list of chat messages .*got int 3"),
        ([], r"the prompt must be a string or a non-empty list of chat messages .*got list \[\]"),
        ([{"role": "user"}], r"chat message 0 must be an object with string 'role' and 'content'"),
        ([{"role": "user", "content": "a"}, "b"], r"chat message 1 must be an object"),
        ([{"role": "user", "content": ["a"]}], r"chat message 0 must be an object"),
    ],
)
def test_bad_prompt_value(tmp_path, prompt, message):
    path = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "ok"}, {"prompt": prompt}])
    with pytest.raises(ValueError, match=r"v\.jsonl, line 2: " + message):
        PromptFile(str(path))


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "e.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"e\.jsonl: the file holds no prompts"):
        PromptFile(str(path))
    json_path = tmp_path / "e.json"
    json_path.write_text("[]")
    with pytest.raises(ValueError, match=r"e\.json: the file holds no prompts"):
        PromptFile(str(json_path))


def test_answer_column_in_some_rows_only(tmp_path):
    rows = [VERL_ROWS[0], {"prompt": CHAT}, VERL_ROWS[1], {"prompt": CHAT, "reward_model": {"style": "rule"}}]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=r"g\.jsonl: answer_key 'reward_model\.ground_truth' is present in 2 rows but missing "
        r"\(or null\) in 2, first at line 2\. Give every row a ground truth",
    ):
        PromptFile(str(path))
    # in parquet a missing value is a null
    with pytest.raises(ValueError, match=r"present in 2 rows but missing \(or null\) in 2, first at row 1"):
        PromptFile(str(write_parquet(tmp_path / "g.parquet", rows)))


def test_answer_of_wrong_type(tmp_path):
    path = write_jsonl(tmp_path / "w.jsonl", [{"prompt": "a", "reward_model": {"ground_truth": ["1", "2"]}}])
    with pytest.raises(
        ValueError, match=r"w\.jsonl, line 1: the ground truth .*must be a string or a number, got list"
    ):
        PromptFile(str(path))


def test_bad_arguments(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a"}])
    with pytest.raises(ValueError, match="limit must be a positive integer or None, got 0"):
        PromptFile(str(path), limit=0)
    with pytest.raises(ValueError, match="prompt_key and answer_key must be non-empty"):
        PromptFile(str(path), prompt_key="")


# --- encode_prompt ---------------------------------------------------------------------------------

VOCAB = [
    "<unk>",
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "what",
    "is",
    "2+2?",
    "be",
    "brief",
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def tokenizer():
    """A word-level tokenizer: ids are positions in VOCAB; plain text gets BOS (<s> = 1) prepended."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_encode_plain_text(tokenizer):
    # "what is 2+2?" -> what=6 is=7 2+2?=8, BOS <s>=1 in front unless add_special_tokens=False
    assert encode_prompt(Prompt("what is 2+2?"), tokenizer) == [1, 6, 7, 8]
    assert encode_prompt(Prompt("what is 2+2?"), tokenizer, add_special_tokens=False) == [6, 7, 8]
    assert encode_prompt(Prompt("what is 2+2?"), tokenizer, chat_template=False) == [1, 6, 7, 8]


def test_encode_chat_messages(tokenizer):
    tokenizer.chat_template = TEMPLATE
    # "<s><|system|> be brief <|user|> what is 2+2? <|assistant|>"
    expected = [1, 3, 9, 10, 4, 6, 7, 8, 5]
    ids = encode_prompt(Prompt(CHAT), tokenizer)
    assert ids == expected and type(ids) is list and all(type(i) is int for i in ids)
    # plain text with chat_template=True becomes one user message: <s> <|user|> what is 2+2? <|assistant|>
    assert encode_prompt(Prompt("what is 2+2?"), tokenizer, chat_template=True) == [1, 4, 6, 7, 8, 5]
    # plain text with the default None is not templated even though the tokenizer has a template
    assert encode_prompt(Prompt("what is 2+2?"), tokenizer) == [1, 6, 7, 8]


@pytest.mark.parametrize(
    "returned",
    [
        BatchEncoding({"input_ids": [1, 4, 5], "attention_mask": [1, 1, 1]}),
        {"input_ids": [1, 4, 5]},
        [[1, 4, 5]],
        torch.tensor([[1, 4, 5]]),
    ],
)
def test_encode_accepts_any_apply_chat_template_return_type(tokenizer, monkeypatch, returned):
    tokenizer.chat_template = TEMPLATE
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: returned)
    ids = encode_prompt(Prompt([{"role": "user", "content": "x"}]), tokenizer)
    assert ids == [1, 4, 5] and all(type(i) is int for i in ids)


def test_encode_errors(tokenizer):
    with pytest.raises(ValueError, match=r"has no chat template.*Set `tokenizer.chat_template`"):
        encode_prompt(Prompt(CHAT), tokenizer)
    with pytest.raises(ValueError, match=r"has no chat template"):
        encode_prompt(Prompt("what is 2+2?"), tokenizer, chat_template=True)
    tokenizer.chat_template = TEMPLATE
    with pytest.raises(ValueError, match=r"chat messages need the chat template.*Pass chat_template=None or True"):
        encode_prompt(Prompt(CHAT), tokenizer, chat_template=False)
