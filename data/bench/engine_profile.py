"""Where a rollout round of `--engine transformers` spends its time (README, "Results").

    python data/bench/engine_profile.py

The CPU demo's first round (16 prompts x 4 samples, at most 32 new tokens, bf16 autocast where the
CPU has bf16) through dapo's own generate, twice on the FSDP2-wrapped policy and twice on the same
weights unwrapped (the second of each is timed), then cProfile's top entries by own time for one
more round on the FSDP2 policy. Output: data/results/<cpu>/engine_profile.txt.
"""

import cProfile
import io
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import dapo  # noqa: E402
import torch  # noqa: E402


def round_seconds(engine, prompt_ids, cfg, seeds):
    """Seconds and sampled tokens of one rollout round."""
    start = time.time()
    groups = dapo.generate(engine, prompt_ids, cfg.group_size, cfg.max_response_len,
                           cfg.temperature, cfg.top_p, seeds)
    return time.time() - start, sum(len(s.ids) for group in groups for s in group)


def main():
    from transformers import AutoModelForCausalLM

    cfg = dapo.parse_args(["--preset", "cpu", "--engine", "transformers"])[0]
    layout = dapo.init_distributed(cfg)
    dapo.ensure_demo_model(cfg.model)
    tok, model = dapo.load_policy(cfg, layout)
    engine = dapo.make_engine(cfg, layout, model, tok)
    train_set = dapo.load_examples(cfg.train_data, tok, cfg.max_prompt_len, True)
    prompts = dapo.take_prompts(train_set, 0, cfg.gen_prompts_per_round, cfg.seed)
    prompt_ids = [p["prompt_ids"] for p in prompts]
    seeds = dapo.rollout_seeds(prompts, cfg)
    round_seconds(engine, prompt_ids, cfg, seeds)
    print("FSDP2 policy: %.2f s, %d tokens" % round_seconds(engine, prompt_ids, cfg, seeds))
    plain = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    unwrapped = dapo.PolicyEngine(plain, engine.device, engine.eos_ids, engine.pad_id,
                                  engine.autocast)
    round_seconds(unwrapped, prompt_ids, cfg, seeds)
    print("unwrapped:    %.2f s, %d tokens" % round_seconds(unwrapped, prompt_ids, cfg, seeds))
    profile = cProfile.Profile()
    profile.enable()
    round_seconds(engine, prompt_ids, cfg, seeds)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    print(text.getvalue())
    dapo.close(None)


if __name__ == "__main__":
    main()
