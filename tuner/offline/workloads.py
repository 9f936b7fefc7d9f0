"""Synthetic sparse inputs with a controlled index overlap, the same on every rank that asks.

Every rank holds ``k`` entries. ``s`` indices are common to all ranks, and
each rank adds ``k - s`` private indices that no other rank holds, so by the
definition of overlap in :mod:`colltune.model.features` (``(K - u) / (K - max k_p)`` with
``K = P k`` and ``u = s + P (k - s)``) the overlap is exactly ``s / k``.
The indices are drawn from one random permutation of the ``n`` rows (a seed
every rank shares), so they are spread over the whole range, and are handed
out in permutation order (unsorted, as an embedding gradient's are).

When the rows do not suffice for the requested overlap (``u > n``), ``s`` is
raised to the least feasible value and :attr:`Workload.overlap` reports the
overlap achieved, which the caller must report instead of the one requested.

Example:
    >>> from colltune.offline.workloads import Workload
    >>> w = Workload(n=1000, k=100, world_size=4, overlap=0.5)
    >>> w.shared, w.overlap
    (50, 0.5)
    >>> idx, vals = w.make(rank=0)
    >>> idx.shape, vals.shape
    (torch.Size([100]), torch.Size([100]))
"""

from __future__ import annotations

import torch

from colltune.algorithms.errors import ColltuneValueError
from colltune.model.features import least_shared

__all__ = ["Workload", "shared_count", "k_for_density"]


def k_for_density(n: int, density: float) -> int:
    """Return the entries per rank for ``density`` of ``n`` rows: ``round(density * n)``, at least 1."""
    return max(1, min(n, int(round(density * n))))


def shared_count(n: int, k: int, world_size: int, overlap: float) -> int:
    """Return the number of indices common to all ranks: ``round(overlap * k)``, raised until the union fits in ``n``.

    Raises:
        ColltuneValueError: ``k > n`` (no overlap can fit), or ``overlap`` outside [0, 1].
    """
    if not 0.0 <= overlap <= 1.0:
        raise ColltuneValueError(f"overlap must be in [0, 1], but got {overlap}.")
    if k > n:
        raise ColltuneValueError(f"k must be <= n, but got k={k} entries per rank for n={n} rows; lower the density.")
    return min(max(int(round(overlap * k)), least_shared(n, k, world_size)), k)


class Workload:
    """One benchmark input: ``k`` entries per rank over ``n`` rows with a controlled overlap.

    Args:
        n: number of dense rows.
        k: entries per rank.
        world_size: number of ranks.
        overlap: requested overlap in [0, 1]; :attr:`overlap` is the one achieved.
        row_shape: shape of one value row (``()`` for scalars).
        dtype: value dtype.
        seed: shared seed; the same seed gives the same inputs on every rank.

    Raises:
        ColltuneValueError: a size is < 1, ``k > n``, or ``overlap`` is outside [0, 1].
    """

    __slots__ = ("n", "k", "world_size", "overlap_requested", "row_shape", "dtype", "seed", "shared")

    def __init__(
        self,
        n: int,
        k: int,
        world_size: int,
        overlap: float = 0.0,
        *,
        row_shape: tuple[int, ...] = (),
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        if n < 1 or k < 1 or world_size < 1:
            raise ColltuneValueError(
                f"n, k and world_size must be >= 1, but got n={n}, k={k}, world_size={world_size}."
            )
        self.n, self.k, self.world_size = int(n), int(k), int(world_size)
        self.overlap_requested = float(overlap)
        self.row_shape = tuple(int(d) for d in row_shape)
        self.dtype = dtype
        self.seed = int(seed)
        #: Indices common to all ranks.
        self.shared = shared_count(self.n, self.k, self.world_size, self.overlap_requested)

    def __repr__(self) -> str:
        return (
            f"Workload(n={self.n}, k={self.k}, world_size={self.world_size}, overlap={self.overlap:.3g}, "
            f"row_shape={self.row_shape}, dtype={self.dtype}, seed={self.seed})"
        )

    @property
    def overlap(self) -> float:
        """The overlap achieved: ``shared / k`` (1 for a single rank)."""
        return 1.0 if self.world_size == 1 else self.shared / self.k

    @property
    def union(self) -> int:
        """The number of distinct indices over all ranks."""
        return self.shared + self.world_size * (self.k - self.shared)

    def _generator(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + salt) % (2**63))

    def make(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(indices, values)`` of ``rank``: int64 ``[k]`` and ``[k, *row_shape]`` random normal values."""
        if not 0 <= rank < self.world_size:
            raise ColltuneValueError(f"rank must be in [0, {self.world_size}), but got {rank}.")
        s, k = self.shared, self.k
        perm = torch.randperm(self.n, generator=self._generator(0))
        private = perm[s + rank * (k - s) : s + (rank + 1) * (k - s)]
        idx = torch.cat((perm[:s], private))
        # Mix common and private indices, deterministically per rank.
        idx = idx[torch.randperm(k, generator=self._generator(1 + 2 * rank))]
        vals = torch.randn((k,) + self.row_shape, generator=self._generator(2 + 2 * rank), dtype=torch.float32)
        return idx, vals.to(self.dtype)
