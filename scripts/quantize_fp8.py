"""Write an FP8 block checkpoint (Hugging Face fine-grained format) from a float checkpoint.

    python scripts/quantize_fp8.py SRC DST [--block 128 128] [--not-convert lm_head embed_tokens ...]

Scales are each block's amax / 448 (`weight_scale_inv`); config.json gains quantization_config;
tokenizer and generation files are copied. The default --not-convert list keeps the head, the
embedding, the routers (mlp.gate, mlp.shared_expert_gate) and linear_attn.in_proj_ba in float.
"""

import argparse
import sys

from strata.model.config import CheckpointError
from strata.model.quantize import DEFAULT_NOT_CONVERT, quantize_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("BO", "BI"))
    ap.add_argument("--not-convert", nargs="*", default=list(DEFAULT_NOT_CONVERT),
                    help="module names kept in float (whole dotted components match)")
    a = ap.parse_args()
    try:
        quantize_checkpoint(a.src, a.dst, a.block, a.not_convert)
    except (CheckpointError, OSError) as e:  # OSError: DST not writable, disk full
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
