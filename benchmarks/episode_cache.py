"""Wall time of one rollout's episodes with and without HFEngine's KV-cache reuse (``reuse_kv_cache``).

    OMP_NUM_THREADS=1 python benchmarks/episode_cache.py      # experiments/multiturn.yaml's rollout
    OMP_NUM_THREADS=1 python benchmarks/episode_cache.py --prompts 8 --repeats 5
    OMP_NUM_THREADS=1 python benchmarks/episode_cache.py --prompt-tokens 300   # long contexts, random weights

The rollout is that of experiments/multiturn.yaml: 32 RevealedChain prompts x 8 episodes of RunningSums
(max_turns 3) on the embedded episode model, HFEngine(max_new_tokens=4, temperature=1.0), float32. Prints the
median (and min-max) wall seconds of ``EpisodeRunner.run`` over ``--repeats`` rollouts after one warm-up, the
tokens each engine ran through its model per rollout, whether both played the same episodes, and the load.

``--prompt-tokens N`` instead times 3 turns of 64 rows of N prompt tokens on the tiny random-weight model
(``max_new_tokens=8``, 4 observation tokens a turn): the case where re-encoding the row costs more than a turn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per rollout (data.prompts_per_step)")
    parser.add_argument("--samples", type=int, default=8, help="episodes per prompt (data.samples_per_prompt)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rollouts per setting (the median is shown)")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="time long synthetic rows instead (see above)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.prompt_tokens:
        synthetic(args.prompt_tokens, args.repeats)
        return

    from rlkit.data.prompts import encode_prompt
    from rlkit.embedded import RevealedChain, RunningSums
    from rlkit.embedded.cache import embedded_checkpoint
    from rlkit.engines.hf import HFEngine
    from rlkit.environments import EpisodeRunner
    from rlkit.models import load_tokenizer

    checkpoint = str(embedded_checkpoint(episodes=True))
    tokenizer = load_tokenizer(checkpoint)
    data = RevealedChain(num_prompts=16384, min_terms=2, max_terms=4, max_operand=9, split="train")
    print(f"load before: {open('/proc/loadavg').read().strip()}")
    results = {}
    for reuse in (False, True):
        engine = HFEngine(max_new_tokens=4, temperature=1.0, reuse_kv_cache=reuse)
        engine.start(checkpoint)
        fed = [0]
        engine.model.register_forward_pre_hook(
            lambda module, a, kwargs, fed=fed: fed.__setitem__(0, fed[0] + kwargs["input_ids"].numel()),
            with_kwargs=True,
        )
        runner = EpisodeRunner(RunningSums(max_turns=3), engine, tokenizer)
        walls, episodes = [], []
        for repeat in range(args.repeats + 1):  # rollout 0 warms up
            prompts = [data[repeat * args.prompts + i] for i in range(args.prompts)]
            ids = [encode_prompt(p, tokenizer) for p in prompts]
            fed[0] = 0
            start = time.perf_counter()
            played = runner.run(prompts, ids, args.samples, list(range(repeat, repeat + args.prompts)))
            if repeat:
                walls.append(time.perf_counter() - start)
            episodes.append([(e.token_ids, e.model_mask) for row in played for e in row])
        turns = sum(e.turns for row in played for e in row) / (args.prompts * args.samples)
        results[reuse] = episodes
        print(
            f"reuse_kv_cache={reuse!s:5}  wall/rollout {statistics.median(walls):.3f} s "
            f"({min(walls):.3f}-{max(walls):.3f}), tokens fed {fed[0]}, turns/episode {turns:.2f}"
        )
    print(f"same episodes: {results[False] == results[True]}")
    print(f"load after: {open('/proc/loadavg').read().strip()}")


def synthetic(prompt_tokens: int, repeats: int) -> None:
    """3 turns of 64 rows of ``prompt_tokens`` tokens through ``engine.session()``, tiny random weights."""
    import tempfile

    from rlkit.embedded.model import build_tiny_checkpoint
    from rlkit.engines.hf import HFEngine

    checkpoint = str(build_tiny_checkpoint(tempfile.mkdtemp(prefix="rlkit-bench-"), seed=3))
    print(f"load before: {open('/proc/loadavg').read().strip()}")
    for reuse in (False, True):
        engine = HFEngine(max_new_tokens=8, reuse_kv_cache=reuse)
        engine.start(checkpoint)
        walls = []
        for repeat in range(repeats + 1):  # rollout 0 warms up
            rows = [[1] + [4 + (k * 7 + i) % 40 for k in range(prompt_tokens)] for i in range(64)]
            start = time.perf_counter()
            with engine.session() as generator:
                for turn in range(3):
                    out = generator.generate(rows, 1, seed=[100 * turn + i for i in range(len(rows))])
                    rows = [r + g.token_ids + [5, 6, 7, 8] for r, [g] in zip(rows, out, strict=True)]
            if repeat:
                walls.append(time.perf_counter() - start)
        print(
            f"reuse_kv_cache={reuse!s:5}  wall/rollout {statistics.median(walls):.3f} s "
            f"({min(walls):.3f}-{max(walls):.3f}), {prompt_tokens}-token prompts x 64 rows x 3 turns"
        )
    print(f"load after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
