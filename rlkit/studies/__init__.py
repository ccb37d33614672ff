"""Ablation studies: ``rlkit ablate`` runs every variant x seed of a study, ``rlkit compare`` reports on it.

- :mod:`rlkit.studies.plan`: what a study is (base config, factors, seeds) and its ``study.yaml``.
- :mod:`rlkit.studies.variants`: each variant parsed by ``rlkit fit``'s own parser before anything runs.
- :mod:`rlkit.studies.runner`: the runs, as ``rlkit fit`` processes; skip finished, resume interrupted.
- :mod:`rlkit.studies.report`: TensorBoard events to ``summary.md``, ``summary.csv`` and plots.
- :mod:`rlkit.studies.commands`: the two commands' arguments.
"""
