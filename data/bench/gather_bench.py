"""A round's gather across ranks: dapo.gather_groups (one float64 tensor per engine) against the
pickled gather it replaced (all_gather_object of the Group objects), on synthetic scored rounds,
same inputs, results checked equal. Gloo on CPU here; on GPUs the tensor goes over NCCL.

    torchrun --nproc_per_node 2 data/bench/gather_bench.py                 # the shapes below
    torchrun --nproc_per_node 2 data/bench/gather_bench.py --shape 96,16,1000

A shape is prompts in the round, samples a prompt (G), mean response tokens (lengths uniform in
1 .. 2 x mean). Prints one JSON line a shape: median seconds of each over --repeat calls.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dapo  # noqa: E402
from test_dapo import _gather_by_pickle as by_pickle  # noqa: E402  the tests' reference gather

# the CPU demo's round (16 prompts x 4, 32-token limit), dapo_1.5b's (96 x 16, 3,072-token limit,
# about 1,000 tokens a response), and one 4x that
SHAPES = ["16,4,20", "96,16,1000", "192,16,2000"]


def round_of(n_prompts, group_size, mean_tokens, seed):
    rng = random.Random(seed)
    prompts = [dict(idx=i, pos=i, prompt_ids=[rng.randrange(150000) for _ in range(100)],
                    answer=str(i)) for i in range(n_prompts)]
    groups = []
    for prompt in prompts:
        samples = []
        for _ in range(group_size):
            n = rng.randint(1, 2 * mean_tokens)
            ids = [rng.randrange(150000) for _ in range(n)]
            logps = [-rng.random() * 5 for _ in range(n)]
            samples.append(dapo.Sample(ids, rng.choice(["stop", "length"]), logps,
                                       score=rng.choice([1.0, -1.0]), penalty=-rng.random()))
        groups.append(dapo.Group(**prompt, samples=samples))
    return prompts, groups


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", action="append", help="prompts,G,mean tokens (repeatable)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = dapo.Layout(rank=rank, world=world, tp=1, dp_rank=rank, n_dp=world,
                         device=torch.device("cpu"))
    for shape in args.shape or SHAPES:
        n_prompts, group_size, mean_tokens = map(int, shape.split(","))
        prompts, groups = round_of(n_prompts, group_size, mean_tokens, seed=0)
        mine = groups[rank::world]
        times = {"pickle": [], "tensor": []}
        for _ in range(args.repeat):
            for name in times:
                dist.barrier()
                t0 = time.perf_counter()
                if name == "pickle":
                    got = by_pickle(mine, layout)
                else:
                    got = dapo.gather_groups(mine, prompts, layout)
                times[name].append(time.perf_counter() - t0)
                assert got == groups, name
        if rank == 0:
            tokens = sum(len(s.ids) for g in groups for s in g.samples)
            medians = {f"{name}_s": round(statistics.median(t), 4) for name, t in times.items()}
            print(json.dumps(dict(shape=shape, ranks=world, tokens=tokens, **medians,
                                  cpu_threads=torch.get_num_threads())), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
