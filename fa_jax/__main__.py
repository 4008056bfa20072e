"""``python -m fa_jax``: the ``fa-jax`` command."""

import sys

from fa_jax.cli import main

sys.exit(main())
