"""FlashAttention-3 Table 3 (§4.3): FP16/FP8 RMSE on outlier inputs (see fa_jax.fa3_table).

Usage: python experiments/fa3_table.py [--quick] [--out DIR] [--ablations]
"""

from fa_jax.fa3_table import main

if __name__ == "__main__":
    main()
