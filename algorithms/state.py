"""State kept between calls: Ok-Topk region boundaries, thresholds and residuals.

State is kept apart from the algorithms (which are stateless singletons), as
PyTorch's ``PowerSGDState`` is: it validates its options in ``__init__``,
uses ``__slots__``, and round-trips through ``state_dict()`` /
``load_state_dict()`` with no process group inside, so it can be checkpointed.
"""

from __future__ import annotations

import math
from typing import Any

from colltune.algorithms.comm import Comm
from colltune.algorithms.errors import ColltuneTypeError, ColltuneValueError
from colltune.algorithms.lazy import torch

__all__ = ["BoundaryState", "TopkState"]


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ColltuneTypeError(f"{name} must be an int >= {minimum}, but got {value!r}.")
    if value < minimum:
        raise ColltuneValueError(f"{name} must be an int >= {minimum}, but got {value}.")
    return value


class BoundaryState:
    """Region boundaries that balance the ranks' entries (Ok-Topk's split).

    Region ``j`` owns rows ``[cuts[j], cuts[j+1])`` with ``cuts[0] = 0`` and
    ``cuts[P] = size``. Each refresh, every rank proposes the index at every
    ``(k_p / P)``-th position of its sorted indices, and the proposals are
    averaged over the ranks that have entries, in one small ``all_reduce``.
    Between refreshes the cuts are reused; since every rank refreshes at the
    same calls from the same reduced numbers, all ranks hold the same cuts.

    Args:
        refresh: recompute the cuts every this many calls.
    """

    __slots__ = ("refresh", "cuts", "calls", "size", "world_size")

    def __init__(self, refresh: int = 64) -> None:
        self.refresh = _check_int("boundary_refresh", refresh)
        #: The ``P + 1`` cut points, on the host (read every call: never from a device).
        self.cuts: list[int] | None = None
        self.calls = 0
        self.size = -1
        self.world_size = -1

    def cached(self, size: int, world_size: int) -> list[int] | None:
        """Return the cuts the next :meth:`get` will return without a refresh, or ``None`` if one is due.

        Nothing changes; a collective caller can learn the regions before
        :meth:`get` (every rank gets the same answer: it depends only on the
        calls made so far).
        """
        if self.due(size, world_size):
            return None
        return list(self.cuts)  # type: ignore[arg-type]

    def due(self, size: int, world_size: int) -> bool:
        """Return whether the next :meth:`get` refreshes the cuts (collectively)."""
        return self.cuts is None or self.size != size or self.world_size != world_size or self.calls % self.refresh == 0

    def get(self, indices: torch.Tensor, size: int, comm: Comm) -> list[int]:
        """Return the ``P + 1`` cut points for this call, refreshing them when due.

        Args:
            indices: this rank's sorted unique int64 indices (may be empty).
            size: number of rows.
            comm: the group (the refresh is collective).
        """
        p = comm.world_size
        if self.due(size, p):
            self.cuts = self._compute(indices, size, comm).tolist()
            self.size, self.world_size, self.calls = size, p, 0
        self.calls += 1
        return list(self.cuts)  # type: ignore[arg-type]

    @staticmethod
    def _compute(indices: torch.Tensor, size: int, comm: Comm) -> torch.Tensor:
        p = comm.world_size
        k = indices.numel()
        buf = torch.zeros(p, dtype=torch.float64, device=comm.device)
        if k > 0 and p > 1:
            pos = (torch.arange(1, p, device=indices.device) * k) // p
            buf[: p - 1] = indices[pos].to(torch.float64).to(comm.device)
            buf[p - 1] = 1.0
        if p > 1:
            comm.all_reduce(buf)
        voters = buf[p - 1].item() if p > 1 else 0.0
        if voters > 0:
            inner = torch.round(buf[: p - 1] / voters).to(torch.int64).cpu()
        else:  # nobody has entries: uniform ranges
            inner = torch.arange(1, p, dtype=torch.int64) * size // p
        cuts = torch.cat((torch.zeros(1, dtype=torch.int64), inner.clamp(0, size), torch.tensor([size])))
        return torch.cummax(cuts, 0).values

    def state_dict(self) -> dict[str, Any]:
        """Return the boundaries as plain data."""
        return {
            "refresh": self.refresh,
            "cuts": None if self.cuts is None else list(self.cuts),
            "calls": self.calls,
            "size": self.size,
            "world_size": self.world_size,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.refresh = _check_int("boundary_refresh", d["refresh"])
        cuts = None if d["cuts"] is None else [int(c) for c in d["cuts"]]
        size = int(d["size"])
        if cuts is not None and (not cuts or cuts[0] != 0 or cuts[-1] != size or any(a > b for a, b in zip(cuts, cuts[1:]))):
            raise ColltuneValueError(
                f"the boundary state's cuts must rise from 0 to its size {size}, but got {cuts[:3]}...{cuts[-2:]}; "
                "load a state this version of colltune saved, or start without one."
            )
        self.cuts = cuts
        self.calls, self.size, self.world_size = int(d["calls"]), size, int(d["world_size"])


class TopkState:
    """Residuals and thresholds of one tensor under top-k compression.

    Give exactly one of ``k`` (entries per rank per call) or ``density``
    (``k = max(1, round(density * numel))``). One state per tensor.

    Args:
        k: entries each rank selects per call.
        density: fraction of the tensor each rank selects per call.
        local_refresh: compute the exact local threshold (a top-k) every this
            many calls; in between, reuse and nudge it (Ok-Topk uses 32).
        global_refresh: compute the exact global threshold every this many
            calls; in between, reuse and nudge it (it is computed exactly
            early, too, when no nudge keeps the count in the band).
        boundary_refresh: recompute the region boundaries every this many calls.
        band: ``(low, high)``: the selected count is kept in ``[low*k, high*k]``.
        nudge: relative step by which a reused local threshold is moved when
            the count leaves the band (up to 4 times, then an exact top-k); a
            reused global threshold is tried at 8 half steps each side at
            once, and the candidate whose global count is in the band and
            closest to k is kept.
        peers_in_flight: point-to-point exchanges posted at once in the split.

    Example:
        >>> state = TopkState(density=0.01)
        >>> res = colltune.topk_allreduce(grad, state, op="avg")  # doctest: +SKIP
    """

    __slots__ = (
        "k",
        "density",
        "local_refresh",
        "global_refresh",
        "band",
        "nudge",
        "peers_in_flight",
        "boundaries",
        "residual",
        "_local_threshold",
        "_global_threshold",
        "step",
        "last_local_count",
        "last_global_count",
        "global_exact_due",
    )

    def __init__(
        self,
        k: int | None = None,
        density: float | None = None,
        *,
        local_refresh: int = 32,
        global_refresh: int = 32,
        boundary_refresh: int = 64,
        band: tuple[float, float] = (2 / 3, 5 / 4),
        nudge: float = 0.05,
        peers_in_flight: int = 8,
    ) -> None:
        if (k is None) == (density is None):
            raise ColltuneValueError(
                f"TopkState needs exactly one of k or density, but got k={k!r}, density={density!r}; "
                "for example TopkState(density=0.01) or TopkState(k=1000)."
            )
        if k is not None:
            _check_int("k", k)
        if density is not None:
            if isinstance(density, bool) or not isinstance(density, (int, float)):
                raise ColltuneTypeError(f"density must be a float in (0, 1], but got {density!r}.")
            if not 0.0 < float(density) <= 1.0:
                raise ColltuneValueError(f"density must be in (0, 1], but got {density}.")
        lo, hi = (float(b) for b in band)
        if not 0.0 < lo <= 1.0 <= hi:
            raise ColltuneValueError(f"band must be (low, high) with 0 < low <= 1 <= high, but got {band!r}.")
        if not 0.0 < nudge < 1.0:
            raise ColltuneValueError(f"nudge must be in (0, 1), but got {nudge!r}.")
        self.k = k
        self.density = None if density is None else float(density)
        self.local_refresh = _check_int("local_refresh", local_refresh)
        self.global_refresh = _check_int("global_refresh", global_refresh)
        self.band = (lo, hi)
        self.nudge = float(nudge)
        self.peers_in_flight = _check_int("peers_in_flight", peers_in_flight)
        self.boundaries = BoundaryState(boundary_refresh)
        self.residual: torch.Tensor | None = None
        self._local_threshold: float | torch.Tensor | None = None
        self._global_threshold: float | torch.Tensor | None = None
        self.step = 0
        self.last_local_count = 0
        self.last_global_count = 0
        self.global_exact_due = True

    @property
    def local_threshold(self) -> float | None:
        """Ok-Topk's last local threshold in top-k mode, or ``None`` before its first call.

        A call that selects the exact ``k`` largest on a GPU leaves the
        threshold there, and the next call reads it with its own counts;
        reading it here first waits for the GPU.
        """
        return _as_float(self._local_threshold)

    @local_threshold.setter
    def local_threshold(self, value: float | torch.Tensor | None) -> None:
        self._local_threshold = value

    @property
    def global_threshold(self) -> float | None:
        """Ok-Topk's last global threshold in top-k mode, or ``None``; held on a GPU as :attr:`local_threshold` is."""
        return _as_float(self._global_threshold)

    @global_threshold.setter
    def global_threshold(self, value: float | torch.Tensor | None) -> None:
        self._global_threshold = value

    def local_threshold_held(self) -> float | torch.Tensor | None:
        """The local threshold as held: a 0-dim tensor while it is still on the device, else as :attr:`local_threshold`."""
        return self._local_threshold

    def global_threshold_held(self) -> float | torch.Tensor | None:
        """The global threshold as held (see :meth:`local_threshold_held`)."""
        return self._global_threshold

    def k_for(self, numel: int) -> int:
        """Return the number of entries to select from a tensor of ``numel`` elements."""
        if self.k is not None:
            return min(self.k, numel)
        return min(numel, max(1, int(round(self.density * numel))))  # type: ignore[operator]

    def band_for(self, k: int) -> tuple[int, int]:
        """Return the inclusive ``(low, high)`` count band around ``k``."""
        return max(1, math.floor(self.band[0] * k)), max(1, math.ceil(self.band[1] * k))

    def state_dict(self) -> dict[str, Any]:
        """Return everything needed to resume, as tensors and plain data (no process group)."""
        return {
            "k": self.k,
            "density": self.density,
            "local_refresh": self.local_refresh,
            "global_refresh": self.global_refresh,
            "band": list(self.band),
            "nudge": self.nudge,
            "peers_in_flight": self.peers_in_flight,
            "boundaries": self.boundaries.state_dict(),
            "residual": None if self.residual is None else self.residual.detach().clone(),
            "local_threshold": self.local_threshold,
            "global_threshold": self.global_threshold,
            "step": self.step,
            "last_local_count": self.last_local_count,
            "last_global_count": self.last_global_count,
            "global_exact_due": self.global_exact_due,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        missing = sorted(set(self.state_dict()) - set(d))
        if missing:
            raise ColltuneValueError(f"state_dict is missing keys {missing}; pass a dict made by TopkState.state_dict().")
        fresh = TopkState(
            d["k"],
            d["density"],
            local_refresh=d["local_refresh"],
            global_refresh=d["global_refresh"],
            band=tuple(d["band"]),
            nudge=d["nudge"],
            peers_in_flight=d["peers_in_flight"],
        )
        for name in ("k", "density", "local_refresh", "global_refresh", "band", "nudge", "peers_in_flight"):
            setattr(self, name, getattr(fresh, name))
        self.boundaries = BoundaryState()
        self.boundaries.load_state_dict(d["boundaries"])
        self.residual = None if d["residual"] is None else d["residual"].clone()
        self.local_threshold = d["local_threshold"]
        self.global_threshold = d["global_threshold"]
        self.step = int(d["step"])
        self.last_local_count = int(d["last_local_count"])
        self.last_global_count = int(d["last_global_count"])
        self.global_exact_due = bool(d["global_exact_due"])

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, d: dict[str, Any]) -> None:
        TopkState.__init__(self, d["k"], d["density"])
        self.load_state_dict(d)

    def __repr__(self) -> str:
        target = f"k={self.k}" if self.k is not None else f"density={self.density}"
        return f"TopkState({target}, step={self.step}, local_threshold={self.local_threshold})"


def _as_float(th: float | torch.Tensor | None) -> float | None:
    """A threshold as a float (a 0-dim tensor is read), or ``None``."""
    return th if th is None or isinstance(th, float) else float(th)
