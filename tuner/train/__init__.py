"""colltune in a training loop: the DDP comm hook and the sparse-gradient synchronizer.

=================  ==========================================================
module             contract
=================  ==========================================================
``hook``           :func:`colltune_hook` and :class:`ColltuneHookState`:
                   dense gradients, compressed by top-k inside DDP's buckets
``sync``           :class:`SparseGradSync`: the sparse gradients of
                   ``nn.Embedding(sparse=True)`` (which DDP cannot reduce on
                   NCCL), and optionally the dense ones
``common``         routing per parameter, checks and state records both share
=================  ==========================================================
"""

from colltune.train.common import TensorStats
from colltune.train.hook import ColltuneHookState, colltune_hook
from colltune.train.sync import SparseGradSync, sparse_parameters

__all__ = ["ColltuneHookState", "SparseGradSync", "TensorStats", "colltune_hook", "sparse_parameters"]
