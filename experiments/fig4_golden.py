"""Golden et al. 2024, Fig 4 (flash vs baseline against the FP64 golden): ``fa-jax reproduce fig4``.

Usage: python experiments/fig4_golden.py [--quick] [--out DIR] [other flags of fa-jax reproduce]
"""

import sys

from fa_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "fig4", *sys.argv[1:]]))
