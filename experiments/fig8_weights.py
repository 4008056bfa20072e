"""Golden et al. 2024, Figs 7-8 (weight drift over training): ``fa-jax reproduce fig8``.

Needs optax (``pip install 'fa-jax[train]'``).

Usage: python experiments/fig8_weights.py [--quick] [--out DIR] [other flags of fa-jax reproduce]
"""

import sys

from fa_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", "fig8", *sys.argv[1:]]))
