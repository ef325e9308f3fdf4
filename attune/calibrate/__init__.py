"""Calibration against published runs: the corpus reader, the report and the global fit of the coefficients.

``corpus`` reads ``shared/measurements`` (and the seed recipe's observations) into typed rows, ``report``
predicts every row it can express and scores it, ``fit`` refits the estimator's global coefficients and
writes them as package data (``attune/estimator/coefficients.yaml``). Imported only by ``attune.api`` and
``attune.cli``.
"""
