"""The Triton fallback's candidate configs (``llmc.engine.torch.int4_tune_triton``, which ``llmc tune`` and
``tune_int4_cuda.py --kernels triton`` tune) of each row bucket (``[block_m, block_n, unroll, warps, stages,
split_k]``):

    python scripts/tune_int4_triton.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.engine.torch.int4_tune_triton import BUCKETS, candidates  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the short list tried for shapes that are only checked")
    args = ap.parse_args()
    for _, m in BUCKETS:
        print(f"M={m}: " + " ".join(str(c.to_list()) for c in candidates(m, args.quick)))


if __name__ == "__main__":
    main()
