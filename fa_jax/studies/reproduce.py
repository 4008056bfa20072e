"""``fa-jax reproduce WHICH``: one entry point for every study that regenerates a
figure or a table: Golden et al. 2024's Figs 3–6 (:mod:`fa_jax.studies.figures`;
``"all"`` runs the four), Fig 8 (:mod:`fa_jax.studies.train`), FlashAttention-3's
Table 3 (:mod:`fa_jax.studies.fa3_table`), today's attention features and split-KV
decoding (:mod:`fa_jax.studies.feature_figures`), the inference engines
(:mod:`fa_jax.studies.engine_figures`) and a serving decode
(:mod:`fa_jax.studies.serving`).  The studies beyond Figs 3–6 are imported when
run (some need optional packages)."""

from __future__ import annotations

from fa_jax._checks import one_of
from fa_jax.studies import DEFAULT_POLICIES
from fa_jax.studies.figures import FIGURES

__all__ = ["STUDIES", "reproduce"]

# Every name reproduce takes, Figs 3–6 first.
STUDIES = (*FIGURES, "all", "fig8", "fa3-table", "features", "decoding", "engines", "serving")


def reproduce(
    which: str,
    out_dir,
    *,
    quick: bool,
    policies=DEFAULT_POLICIES,
    quiet: bool = False,
    ablations: bool = False,
) -> dict:
    """Run one figure (``"fig3"`` .. ``"fig6"``), ``"all"`` of those, the training
    study ``"fig8"`` (:func:`fa_jax.studies.train.study.fig8`; needs optax, not in "all"),
    or a study of today's attention features, ``"features"`` or ``"decoding"``
    (:mod:`fa_jax.studies.feature_figures`, not in "all"), or of inference engines,
    ``"engines"`` (:mod:`fa_jax.studies.engine_figures`, not in "all"), or of a
    serving decode, ``"serving"`` (:mod:`fa_jax.studies.serving`, not in "all");
    returns {name: result}."""
    if which == "fig8":
        from fa_jax.studies.train.study import fig8

        return {"fig8": fig8(out_dir, quick=quick, policies=tuple(policies), quiet=quiet)}
    if which == "fa3-table":  # FlashAttention-3 Table 3; not in "all"
        from fa_jax.studies.fa3_table import fa3_table

        if tuple(policies) != DEFAULT_POLICIES:
            raise ValueError(
                f"--policy: fa3-table's rows fix their own policies "
                f"(fa_jax.studies.fa3_table.ROWS), got {list(policies)}"
            )
        return {"fa3-table": fa3_table(out_dir, quick=quick, quiet=quiet, ablations=ablations)}
    if ablations:
        raise ValueError(f"--ablations: only fa3-table has ablation rows, got {which!r}")
    if which in ("features", "decoding"):
        from fa_jax.studies.feature_figures import FEATURE_FIGURES

        study = FEATURE_FIGURES[which]
        return {which: study(out_dir, quick=quick, policies=tuple(policies), quiet=quiet)}
    if which == "engines":  # inference engines vs FP64; not in "all"
        from fa_jax.studies.engine_figures import engines

        return {which: engines(out_dir, quick=quick, policies=tuple(policies), quiet=quiet)}
    if which == "serving":  # a decode of 1 to 32k steps vs FP64; not in "all"
        from fa_jax.studies.serving import serving

        return {which: serving(out_dir, quick=quick, policies=tuple(policies), quiet=quiet)}
    one_of(which, STUDIES, "reproduce: which")
    names = list(FIGURES) if which == "all" else [which]
    policies = tuple(policies)
    return {n: FIGURES[n](out_dir, quick=quick, policies=policies, quiet=quiet) for n in names}
