"""Golden et al. 2024, Fig 3: CSV + table + PNG (see fa_jax.reproduce.fig3).

Usage: python experiments/fig3_formats.py [--quick] [--out DIR] [--policy NAME ...]
"""

from fa_jax.reproduce import main_fig3

if __name__ == "__main__":
    main_fig3()
