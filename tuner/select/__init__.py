"""Choosing the algorithm for a call: policy, then cost model, then argmin.

:mod:`colltune.select.selector` holds the :class:`Selector` (policy rules,
the cost model of the active profile, the per-site decision cache and the
overlap sketch). Every rank reaches the same decision from the same shared
features, so a decision never needs a collective of its own.
"""
