"""Run names from real options: short, stable, and no value cut."""

from rlkit.runs import MAX_NAME, run_name_suffix

OWN_TASK = [
    "--data.prompts=PromptFile",
    "--data.prompts.path=/data/gsm8k_text.jsonl",
    "--data.rewards=[{class_path: MathAnswer}]",
    "--data.prompts_per_step=4",
    "--data.max_prompt_length=256",
]


def test_a_long_command_line_keeps_its_components_and_a_hash_of_the_rest():
    name = run_name_suffix(OWN_TASK)
    assert len(name) <= MAX_NAME and name.startswith("prompts=PromptFile,rewards=MathAnswer,")
    assert "__class_path__" not in name
    kept, rest = name.rsplit(",", 1)
    whole = {"prompts=PromptFile", "prompts.path=gsm8k_text.jsonl", "rewards=MathAnswer", "prompts_per_step=4"}
    assert set(kept.split(",")) <= whole | {"max_prompt_length=256"}  # every part kept is whole
    left_out, digest = rest.removeprefix("+").split("-")
    assert int(left_out) == 5 - len(kept.split(",")) and len(digest) == 6
    assert run_name_suffix(list(reversed(OWN_TASK))).endswith(rest)  # the flags' order does not matter
    changed = run_name_suffix([*OWN_TASK[:-1], "--data.max_prompt_length=512"])
    assert changed != name and len(changed) <= MAX_NAME  # a change left out of the name still changes the hash


def test_short_names_are_written_out_in_full():
    assert run_name_suffix(["--data.rewards=[{class_path: rlkit.rewards.MathAnswer}, {class_path: Format}]"]) == (
        "rewards=MathAnswer+Format"
    )
    assert run_name_suffix(["--model.advantage=GroupNorm", "--seed_everything=1"]) == "advantage=GroupNorm,seed=1"
