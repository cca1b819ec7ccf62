"""Write a tiny random qwen3_next checkpoint (real key names, incl. mtp.*) for tests and demos.

    python scripts/make_tiny_random.py OUT_DIR [--seed 0] [--no-mtp] [--layers 4]
"""

import argparse

from strata.model.tiny import make_tiny_random


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    a = ap.parse_args()
    p = make_tiny_random(a.out, seed=a.seed, with_mtp=not a.no_mtp, num_hidden_layers=a.layers,
                         num_experts=a.experts)
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
