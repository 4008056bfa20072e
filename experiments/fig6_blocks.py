"""Golden et al. 2024, Fig 6 (deviation vs tile sizes): ``fa-jax reproduce fig6``.

Usage: python experiments/fig6_blocks.py [--quick] [--out DIR] [other flags of fa-jax reproduce]
"""

import sys

from fa_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "fig6", *sys.argv[1:]]))
