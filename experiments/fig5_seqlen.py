"""Golden et al. 2024, Fig 5: CSV + table + PNG (see fa_jax.reproduce.fig5).

Usage: python experiments/fig5_seqlen.py [--quick] [--out DIR] [--policy NAME ...]
"""

from fa_jax.reproduce import main_fig5

if __name__ == "__main__":
    main_fig5()
