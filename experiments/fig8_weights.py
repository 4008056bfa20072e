"""Golden et al. 2024, Fig 8: weight drift over training (see fa_jax.train.study).

Usage: python experiments/fig8_weights.py [--quick] [--out DIR] [--policy NAME ...]
"""

from fa_jax.train.study import main

if __name__ == "__main__":
    main()
