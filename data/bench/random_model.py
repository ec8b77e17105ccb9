"""A randomly initialised model as a Hugging Face folder, from a config.json and a small
tokenizer: what dapo.py loads where no weights can be brought (the lent GPU machine has no
network and takes at most 64 MiB, so no real checkpoint). Its samples are noise; its shapes,
memory and speed are the real model's.

    python data/bench/random_model.py data/qwen2.5-0.5b /tmp/qwen-random
    python data/bench/random_model.py CONFIG_DIR OUT_DIR --tokenizer data/tokenizer

The tokenizer (data/tokenizer: SmolLM2-135M-Instruct's, the CPU demo's) has 49,152 ids, so it fits
any vocabulary at least that large (Qwen2.5's 151,936): the model samples ids past it too, and
decoding skips them.
"""

import argparse
import os
import shutil

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "data", "tokenizer")


def write_random_model(config_dir, out_dir, tokenizer_dir=TOKENIZER, seed=0):
    """config_dir's config.json, randomly initialised (seeded) in bf16, and the tokenizer's files,
    saved to out_dir. Returns out_dir."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(config_dir)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tok) > config.vocab_size:
        raise SystemExit(f"random_model: the tokenizer's {len(tok)} ids do not fit the config's "
                         f"vocab_size {config.vocab_size}")
    # The special tokens are the tokenizer's: generate stops on its end of sequence.
    config.bos_token_id = tok.bos_token_id
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    # on the GPU where there is one (0.5B parameters: 16 s in all on two CPU cores)
    device = "cpu"
    if torch.cuda.is_available():
        device = "cuda"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    # copied, not re-saved: the files load under transformers 4 and 5 alike
    for name in os.listdir(tokenizer_dir):
        if name.endswith((".json", ".jinja")):
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config_dir", help="a folder with a config.json (data/qwen2.5-0.5b)")
    parser.add_argument("out_dir", help="the Hugging Face folder to write")
    parser.add_argument("--tokenizer", default=TOKENIZER, help="a tokenizer folder to copy")
    args = parser.parse_args()
    write_random_model(args.config_dir, args.out_dir, args.tokenizer)
    print(f"random_model: {args.out_dir}", flush=True)


if __name__ == "__main__":
    main()
