"""Golden et al. 2024, Fig 4: CSV + table + PNG (see fa_jax.reproduce.fig4).

Usage: python experiments/fig4_golden.py [--quick] [--out DIR] [--policy NAME ...]
"""

from fa_jax.reproduce import main_fig4

if __name__ == "__main__":
    main_fig4()
