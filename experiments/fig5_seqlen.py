"""Golden et al. 2024, Fig 5 (deviation vs sequence length): ``fa-jax reproduce fig5``.

Usage: python experiments/fig5_seqlen.py [--quick] [--out DIR] [other flags of fa-jax reproduce]
"""

import sys

from fa_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "fig5", *sys.argv[1:]]))
