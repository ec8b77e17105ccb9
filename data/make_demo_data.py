"""Writes the CPU demo's train and eval sets in the DAPO-Math-17k row shape.

Deterministic: `python data/make_demo_data.py` rewrites the same two files.
Problems are "What is a + b?" with a, b in 1..20 (400 pairs): 32 held out
for evaluation, the other 368 for training.
"""
import json
import os
import random

TEMPLATE = (
    "Solve the following math problem step by step. The last line of your "
    "response should be of the form Answer: $Answer (without quotes) where "
    "$Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def row(a, b, index, split):
    return {
        "data_source": "dapo-demo-addition",
        "prompt": [{"role": "user", "content": TEMPLATE.format(problem=f"What is {a} + {b}?")}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(a + b), "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index, "split": split},
    }


def main():
    pairs = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    random.Random(0).shuffle(pairs)
    here = os.path.dirname(os.path.abspath(__file__))
    for split, chunk in (("eval", pairs[:32]), ("train", pairs[32:])):
        with open(os.path.join(here, f"demo_{split}.jsonl"), "w") as f:
            for i, (a, b) in enumerate(chunk):
                f.write(json.dumps(row(a, b, i, split)) + "\n")


if __name__ == "__main__":
    main()
