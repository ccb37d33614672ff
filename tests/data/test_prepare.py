"""``rlkit data``: GSM8K / MATH files into verl's prompt layout, malformed rows named by file, row and field,
and the overlong-prompt policy."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlkit.cli import main
from rlkit.data.prepare import RECIPES, convert, ground_truth, write_rows
from rlkit.data.prompts import PromptFile
from rlkit.embedded.model import build_tokenizer
from rlkit.rewards import MathAnswer

GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72",
    },
    {"question": "What is 1000 + 234?", "answer": "1000 + 234 = 1234\n#### 1,234"},
]
MATH = [
    {
        "problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?",
        "solution": "We get $\\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
        "level": "Level 1",
        "type": "Algebra",
    }
]


def write_jsonl(path, rows, blank_lines=False):
    lines = [json.dumps(r) for r in rows]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n")
    return path


def run(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["data", *args])
    return exit_info.value.code, capsys.readouterr().err


def test_gsm8k_jsonl_to_verl_layout(tmp_path, capsys):
    source = write_jsonl(tmp_path / "train.jsonl", GSM8K)
    out = tmp_path / "out" / "gsm8k.parquet"
    main(["data", "gsm8k", str(source), "-o", str(out)])
    assert f"wrote 2 prompts to {out}" in capsys.readouterr().out
    rows = pq.read_table(out).to_pylist()
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    assert rows[0]["prompt"] == [{"role": "user", "content": GSM8K[0]["question"] + " " + instruction}]
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert rows[1]["reward_model"]["ground_truth"] == "1234"  # thousands separator removed, as verl does
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["ability"] == "math"
    assert rows[1]["extra_info"] == {"split": "train", "index": 1, **GSM8K[1]}
    # PromptFile reads it with its defaults, and the reference solution scores 1
    prompts = PromptFile(str(out))
    assert prompts.layout == "verl" and [p.ground_truth for p in prompts] == ["72", "1234"]
    reward = MathAnswer(verifier="builtin")
    assert [reward(row["answer"], p) for row, p in zip(GSM8K, prompts, strict=True)] == [1.0, 1.0]


def test_math_parquet_with_options(tmp_path):
    source = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(MATH), source)
    out = tmp_path / "math.jsonl"
    main(["data", "math", str(source), "-o", str(out), "--prompt-format=text", "--instruction=", "--split=dev"])
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["prompt"] == MATH[0]["problem"]  # plain text, no instruction
    assert row["reward_model"]["ground_truth"] == "\\frac{3}{4}"  # the last box, nested braces kept
    assert row["data_source"] == "DigitalLearningGmbH/MATH-lighteval" and row["extra_info"]["split"] == "dev"


def test_system_message_and_default_math_instruction(tmp_path):
    rows, dropped = convert(write_jsonl(tmp_path / "m.jsonl", MATH), RECIPES["math"], "test", system="Be brief.")
    assert dropped == 0
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert rows[0]["prompt"][1]["content"].endswith("output the final answer within \\boxed{}.")


@pytest.mark.parametrize(
    ("answer", "form", "truth"),
    [
        ("so #### -3.5", "gsm8k", "-3.5"),
        ("#### 1,000,000.", "gsm8k", "1000000"),
        ("no final answer", "gsm8k", None),
        ("\\boxed{1} then \\boxed{\\{1, 2\\}}", "boxed", "\\{1, 2\\}"),
        ("\\boxed{\\frac{1}{2", "boxed", None),  # never closed
        ("  42 ", "plain", "42"),
    ],
)
def test_ground_truth(answer, form, truth):
    assert ground_truth(answer, form) == truth


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([GSM8K[0], {"question": "q?"}], r"line 3, field 'answer': missing; the row has fields \['question'\]"),
        ([GSM8K[0], {"question": 7, "answer": "#### 7"}], r"line 3, field 'question': expected non-empty text"),
        ([GSM8K[0], {"question": "q?", "answer": "it is 7"}], r"line 3, field 'answer': no final '#### <number>'"),
    ],
)
def test_malformed_rows_are_named_by_file_line_and_field(tmp_path, capsys, rows, message):
    # blank lines between rows: the line numbers are those an editor shows
    source = write_jsonl(tmp_path / "bad.jsonl", rows, blank_lines=True)
    code, err = run(["gsm8k", str(source), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert code == 2
    assert f"rlkit: error: {source}, " in err
    assert err.count("\n") == 1 and "Traceback" not in err

    assert re.search(message, err), err


def test_malformed_json_and_parquet_rows(tmp_path, capsys):
    source = tmp_path / "broken.jsonl"
    source.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    code, err = run(["gsm8k", str(source), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert code == 2 and f"{source}, line 2: malformed JSON" in err
    parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([MATH[0], {**MATH[0], "solution": "no box"}]), parquet)
    code, err = run(["math", str(parquet), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert code == 2 and f"{parquet}, row 2, field 'solution': no \\boxed{{...}} answer" in err


@pytest.fixture
def tokenizer_dir(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_overlong_prompts_dropped_with_a_count_or_an_error_naming_the_row(tmp_path, tokenizer_dir, capsys):
    rows = [{"question": "short?", "answer": "#### 1"}, {"question": "long " * 40, "answer": "#### 2"}]
    source = write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "o.jsonl"
    # the chat template counts too: "user: short? <instruction>\nassistant: " is ~90 characters, one token each
    args = ["gsm8k", str(source), "-o", str(out), "--tokenizer", str(tokenizer_dir), "--max-prompt-length", "150"]
    main(["data", *args])
    printed = capsys.readouterr().out
    assert "wrote 1 prompts" in printed and "dropped 1 longer than 150 tokens" in printed
    assert [json.loads(line)["reward_model"]["ground_truth"] for line in out.read_text().splitlines()] == ["1"]
    code, err = run([*args, "--long-prompts", "error", "--overwrite"], capsys)
    assert code == 2 and f"{source}, line 2: the prompt has " in err and "more than --max-prompt-length 150" in err
    code, err = run(["gsm8k", str(source), "-o", str(out), "--max-prompt-length", "10"], capsys)
    assert code == 2 and "--max-prompt-length needs --tokenizer" in err


def test_data_files_not_found_or_of_unknown_type(tmp_path, capsys):
    code, err = run(["gsm8k", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert code == 2 and "nope.jsonl: no such file" in err
    (tmp_path / "x.csv").write_text("question,answer\n")
    code, err = run(["gsm8k", str(tmp_path / "x.csv"), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert code == 2 and "unknown file type '.csv'" in err


# ---- no file is replaced unasked ----


def test_an_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path, capsys):
    source = write_jsonl(tmp_path / "train.jsonl", GSM8K)
    original = source.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(source)
    for target in (source, tmp_path / "link.jsonl", tmp_path / "." / "train.jsonl"):
        for extra in ([], ["--overwrite"]):  # not even with --overwrite
            code, err = run(["gsm8k", str(source), "-o", str(target), *extra], capsys)
            assert code == 2 and err.count("\n") == 1
            assert f"-o {target} is the input file itself ({source}): the conversion would replace" in err
    assert source.read_bytes() == original


def test_an_existing_output_is_replaced_only_with_overwrite(tmp_path, capsys):
    source = write_jsonl(tmp_path / "train.jsonl", GSM8K)
    out = tmp_path / "out.jsonl"
    out.write_text("earlier output\n")
    code, err = run(["gsm8k", str(source), "-o", str(out)], capsys)
    assert code == 2
    assert err == f"rlkit: error: -o {out} exists: pass --overwrite to replace it, or choose another file.\n"
    assert out.read_text() == "earlier output\n"
    main(["data", "gsm8k", str(source), "-o", str(out), "--overwrite"])
    assert [json.loads(line)["reward_model"]["ground_truth"] for line in out.read_text().splitlines()] == ["72", "1234"]
    code, err = run(["gsm8k", str(source), "-o", str(tmp_path / "out.json")], capsys)
    assert code == 2 and "give a .jsonl or .parquet file name" in err


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_an_interrupted_write_leaves_the_old_output_intact(tmp_path, suffix):
    out = tmp_path / f"out.{suffix}"
    write_rows([{"a": 1}], out)
    before = out.read_bytes()
    with pytest.raises((TypeError, pa.ArrowException)):  # the second row cannot be written: the write stops midway
        write_rows([{"a": 2}, {"a": object()}], out)
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [out.name]  # no partial file left


def test_a_data_file_that_is_not_utf8_is_named_with_its_line_and_byte_offset(tmp_path, capsys):
    source = tmp_path / "latin1.jsonl"
    first = (json.dumps(GSM8K[0], ensure_ascii=False) + "\n").encode()
    source.write_bytes(first + '{"question": "Caf\xe9?", "answer": "#### 1"}\n'.encode("latin-1"))
    code, err = run(["gsm8k", str(source), "-o", str(tmp_path / "o.jsonl")], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    offset = len(first) + len('{"question": "Caf')
    where = f"byte 0xe9 at byte offset {offset} of the file, byte 18 of the line"
    assert f"rlkit: error: {source}, line 2: not UTF-8 text ({where})" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_dropping_every_row_is_an_error_naming_the_limit_that_fits(tmp_path, tokenizer_dir, capsys):
    rows = [{"question": "long " * 20, "answer": "#### 1"}, {"question": "longer " * 20, "answer": "#### 2"}]
    source, out = write_jsonl(tmp_path / "train.jsonl", rows), tmp_path / "o.jsonl"
    args = ["gsm8k", str(source), "-o", str(out), "--prompt-format", "text", "--tokenizer", str(tokenizer_dir)]
    code, err = run([*args, "--max-prompt-length", "64"], capsys)
    assert code == 2 and "all 2 prompts are longer than --max-prompt-length 64" in err and not out.exists()
    shortest = int(re.search(r"the shortest has (\d+) tokens", err).group(1))
    assert f"raise --max-prompt-length to {shortest}" in err
    main(["data", *args, "--max-prompt-length", str(shortest)])  # the limit it names keeps that row
    assert len(out.read_text().splitlines()) == 1
