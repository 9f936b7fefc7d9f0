"""colltune in a training loop: the DDP comm hook and the sparse-gradient synchronizer.

:mod:`colltune.train.ddp` holds both: :func:`colltune_hook` with its
:class:`ColltuneHookState` (dense gradients, compressed by top-k inside
DDP's buckets) and :class:`SparseGradSync` (the sparse gradients of
``nn.Embedding(sparse=True)``, which DDP cannot reduce on NCCL).
"""

from colltune.train.ddp import ColltuneHookState, SparseGradSync, colltune_hook, sparse_parameters

__all__ = ["ColltuneHookState", "SparseGradSync", "colltune_hook", "sparse_parameters"]
