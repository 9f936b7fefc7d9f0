"""One algorithm knob: its name, default, type, bounds, search range and one-line doc.

An algorithm declares its knobs as a tuple of :class:`Knob` in
:attr:`~colltune.algorithms.base.Algorithm.knob_specs`; everything else reads
them from there: the call's knob check (:meth:`Knob.check_type`,
:meth:`Knob.check_range`), policy
validation, the tuner's search space (:attr:`Knob.search`, :attr:`Knob.tune`),
``colltune explain`` and the README's knob table.

Example:
    >>> k = Knob("peers_in_flight", 8, "point-to-point exchanges posted at once", minimum=1)
    >>> k.kind, k.describe()
    ('int', 'an integer >= 1')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from colltune.algorithms.errors import ColltuneTypeError, ColltuneValueError

__all__ = ["Knob", "Mode", "GATHER_MODES"]

#: The calls a knob can apply to: ``exact`` (``sparse_allreduce``) or ``topk`` (``topk_allreduce``).
Mode = Literal["exact", "topk"]


@dataclass(frozen=True)
class Knob:
    """Type and range of one algorithm knob.

    Attributes:
        name: the key users write, in ``knobs={...}`` and in policies.
        default: the value when nobody sets it; its type sets the knob's
            kind (``bool``, ``int``, ``float``; a ``str`` needs ``choices``).
        help: one line for documentation, policies and ``colltune explain``.
        choices: allowed strings of a choice knob.
        minimum: lower bound of a numeric knob, or ``None``.
        exclusive: whether ``minimum`` itself is excluded.
        state: the knob is a field of the caller's top-k state
            (:class:`~colltune.algorithms.state.TopkState`) rather than a
            call argument; policies may set it, ``knobs=`` may not.
        tune: the modes in which ``colltune tune`` searches it.
        search: the search range ``(low, high, log)`` of a numeric knob;
            ``high`` ``None`` means the world size minus one.
    """

    name: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    exclusive: bool = False
    state: bool = False
    tune: tuple[Mode, ...] = ()
    search: tuple[float, float | None, bool] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.default, str) and self.default not in self.choices:
            raise ColltuneValueError(f"knob {self.name!r}: a string default needs choices that contain it.")
        if self.tune and self.kind in ("int", "float") and self.search is None:
            raise ColltuneValueError(f"knob {self.name!r}: a tuned numeric knob needs a search range.")

    @property
    def kind(self) -> Literal["int", "float", "choice", "bool"]:
        """``choice``, ``bool``, ``int`` or ``float``, from the choices and the default's type."""
        if self.choices:
            return "choice"
        if isinstance(self.default, bool):
            return "bool"
        return "int" if isinstance(self.default, int) else "float"

    def describe(self) -> str:
        """Return what the knob accepts, in words."""
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "bool":
            return "true or false"
        noun = "an integer" if self.kind == "int" else "a number"
        if self.minimum is None:
            return noun
        op = ">" if self.exclusive else ">="
        bound = int(self.minimum) if self.kind == "int" else self.minimum
        return f"{noun} {op} {bound}"

    def check_type(self, value: Any, algorithm: str) -> Any:
        """Return ``value`` if its type fits the knob's kind, else raise :class:`ColltuneTypeError`."""
        kind = self.kind
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, type(self.default)) and not isinstance(value, bool)
        if not ok:
            raise ColltuneTypeError(
                f"{self._where(algorithm)} must be of type {type(self.default).__name__}, but got {value!r}.",
                argument="knobs",
            )
        return value

    def check_range(self, value: Any, algorithm: str) -> Any:
        """Return ``value`` if it is one of the choices and not below the minimum, else raise :class:`ColltuneValueError`."""
        if self.choices and value not in self.choices:
            raise ColltuneValueError(
                f"{self._where(algorithm)} must be one of {', '.join(self.choices)}, but got {value!r}.",
                argument="knobs",
            )
        if self.minimum is not None and (value <= self.minimum if self.exclusive else value < self.minimum):
            raise ColltuneValueError(
                f"{self._where(algorithm)} must be {'>' if self.exclusive else '>='} {self.minimum:g}, "
                f"but got {value}.",
                argument="knobs",
            )
        return value

    def _where(self, algorithm: str) -> str:
        return f"knobs[{self.name!r}] of algorithm {algorithm!r}"

    def search_high(self, world_size: int) -> float:
        """Return the upper end of the search range at ``world_size`` ranks."""
        assert self.search is not None
        high = self.search[1]
        return max(1, world_size - 1) if high is None else high


# --------------------------------------------------------------------------- shared choices

#: How allgather (and Ok-Topk's regions) gather entries.
GATHER_MODES = ("auto", "p2p", "pad", "alltoall")
