"""Golden et al. 2024, Fig 3 (deviation vs mantissa bits): ``fa-jax reproduce fig3``.

Usage: python experiments/fig3_formats.py [--quick] [--out DIR] [other flags of fa-jax reproduce]
"""

import sys

from fa_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "fig3", *sys.argv[1:]]))
