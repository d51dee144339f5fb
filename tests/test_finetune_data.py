"""gptlab.bench.finetune_data: the recipes' data hold out what they say they hold out."""

import json

from gptlab.bench import finetune_data

TEXT = """GLOUCESTER:
Now is the winter of our discontent
Made glorious summer by this sun of York.

ROMEO:
But soft, what light through yonder window breaks?

not a speech

GLOUCESTER:
And all the clouds that lour'd upon our house.
"""


def test_speeches_are_the_named_blocks_with_their_lines_joined():
    assert finetune_data.speeches(TEXT) == [
        ("GLOUCESTER", "Now is the winter of our discontent Made glorious summer by this sun of York."),
        ("ROMEO", "But soft, what light through yonder window breaks?"),
        ("GLOUCESTER", "And all the clouds that lour'd upon our house."),
    ]
    records = finetune_data.speaker_records(TEXT, n_speakers=1)
    assert [r["label"] for r in records] == ["GLOUCESTER", "GLOUCESTER"]


def test_held_out_instructions_share_no_word_or_sum_with_training(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(open(finetune_data.CORPUS).read()[:200_000])
    paths = finetune_data.write("instructions", tmp_path, corpus)
    train, held = ([json.loads(line) for line in paths[p].read_text().splitlines()] for p in ("train", "heldout"))
    assert len(train) == 4000 and len(held) == 200
    assert {r["instruction"] for r in held} == {r["instruction"] for r in train}  # all four tasks in both

    def words(rows):
        return {w for r in rows if "numbers" not in r["instruction"] for w in r["input"].split()}

    def pairs(rows):
        return {tuple(r["input"].split(" + ")) for r in rows if "numbers" in r["instruction"]}

    assert words(train) and words(held) and not words(train) & words(held)
    assert pairs(held) and not pairs(train) & pairs(held)
    for r in train + held:  # every answer is what the task asks
        if "numbers" in r["instruction"]:
            a, b = r["input"].split(" + ")
            assert r["output"] == str(int(a) + int(b))
        elif "Reverse" in r["instruction"]:
            assert r["output"].split() == r["input"].split()[::-1]
