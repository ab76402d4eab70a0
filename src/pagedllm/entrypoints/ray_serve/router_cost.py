"""`python -m pagedllm.entrypoints.ray_serve.router_cost`: what the prefix-aware router
costs per request on this machine: hashing a prompt's blocks (kv/block_hash.py) and
matching them against many replicas' cached sets."""

from __future__ import annotations

import argparse
import random
import time

from pagedllm.kv.block_hash import hash_block, prompt_block_hashes


def rate(fn: object, seconds: float) -> float:
    """Seconds per call of `fn`, over about `seconds`."""
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()  # type: ignore[operator]
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--cached-blocks", type=int, default=20_000, help="per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(2048)]
    bs = args.block_size
    block = tokens[:bs]
    per_block = rate(lambda: hash_block(b"\x00" * 16, block), args.seconds)
    print(f"hash_block: {per_block * 1e6:.2f} us per block of {bs} tokens")
    for n in (512, 2048):
        t = rate(lambda n=n: prompt_block_hashes(tokens[:n], bs), args.seconds)
        print(f"hashing a {n}-token prompt: {t * 1e6:.0f} us")
    hashes = prompt_block_hashes(tokens, bs)
    sets = [
        frozenset(rng.randbytes(16) for _ in range(args.cached_blocks))
        for _ in range(args.replicas)
    ]
    sets[0] = sets[0] | frozenset(hashes)  # one replica holds the whole prompt

    def match() -> int:
        best = 0
        for held in sets:
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            best = max(best, n)
        return best

    t = rate(match, args.seconds)
    print(
        f"longest-prefix match of a 2048-token prompt over {args.replicas} replicas "
        f"({args.cached_blocks} cached blocks each): {t * 1e6:.0f} us"
    )


if __name__ == "__main__":
    main()
