"""FlashAttention-3 Table 3 (FP16 and FP8 RMSE): ``fa-jax reproduce fa3-table``.

Usage: python experiments/fa3_table.py [--quick] [--out DIR] [other flags of fa-jax reproduce]
"""

import sys

from fa_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "fa3-table", *sys.argv[1:]]))
