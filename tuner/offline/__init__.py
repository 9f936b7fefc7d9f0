"""Offline work behind the command line: launch ranks, time, profile, tune, report.

=================  ==========================================================
module             contract
=================  ==========================================================
``launch``         start local ranks (or join ``torchrun``'s) and collect
                   their results; a dead rank is an error, never a hang
``workloads``      synthetic inputs of a given size, density and overlap
``bench``          the timing engine: interleaved rounds of every contender
                   on the same inputs, medians and traffic
``profiling``      measure a grid of configurations into a profile
``active``         active profiling: measure where the model is least sure
``autotune``       Optuna studies over the algorithms' knobs
``report``         decision maps and model-accuracy figures of a profile
=================  ==========================================================

Nothing here runs in a training job; the modules import their heavy
dependencies (Optuna, matplotlib, scikit-learn) where they use them.
"""
