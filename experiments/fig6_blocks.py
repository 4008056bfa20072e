"""Golden et al. 2024, Fig 6: CSV + table + PNG (see fa_jax.reproduce.fig6).

Usage: python experiments/fig6_blocks.py [--quick] [--out DIR] [--policy NAME ...]
"""

from fa_jax.reproduce import main_fig6

if __name__ == "__main__":
    main_fig6()
