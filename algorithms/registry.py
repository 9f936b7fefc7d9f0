"""The algorithm registry: one table from name to :class:`~colltune.algorithms.base.Algorithm`.

Everything above this layer that needs the list of algorithms (policy
validation, the selector, the cost model, the tuner's search space,
``explain``, ``bench``, ``report``) asks :func:`names` and :func:`get`; none
spells the names out. The built-in algorithms register themselves the first
time the registry is read, then the modules :data:`PLUGINS_ENV` names
(which register theirs); :func:`register` adds another one.

Reading the registry needs no torch: the built-in algorithm modules it
loads on first read take torch from :mod:`colltune.algorithms.lazy`, which
imports it when a call first runs, so names, knobs and schedules (what the
cost model, ``explain`` and policy checks read) work where torch is absent.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import TYPE_CHECKING, TypeVar

from colltune.algorithms.errors import ColltuneTypeError, ColltuneValueError

if TYPE_CHECKING:
    from colltune.algorithms.base import Algorithm
    from colltune.algorithms.knobs import Knob

__all__ = ["BUILTIN_NAMES", "PLUGINS_ENV", "plugin_modules", "register", "unregister", "names", "get", "knob_specs"]

#: Modules of the built-in algorithms, in the order :func:`names` lists them.
BUILTIN_MODULES: tuple[str, ...] = (
    "colltune.algorithms.dense",
    "colltune.algorithms.allgather",
    "colltune.algorithms.oktopk",
    "colltune.algorithms.hashpart",
)
#: The built-in algorithms' names (each module is named after its algorithm), in registry order:
#: the algorithms a profile measures and the learned cost model's feature layout.
BUILTIN_NAMES: tuple[str, ...] = tuple(m.rsplit(".", 1)[1] for m in BUILTIN_MODULES)
#: Names no algorithm may take: the front door's own choices.
RESERVED: tuple[str, ...] = ("auto",)

_registry: dict[str, "Algorithm"] = {}
_names: tuple[str, ...] = ()  # the registry's names in the order names() returns, kept by _reorder()
_lock = threading.RLock()
_loaded = False
_loading = False

A = TypeVar("A")


#: Modules to import when the registry is first read, comma-separated, each registering its algorithms
#: (as ``NCCL_TUNER_PLUGIN`` names NCCL's tuner plugin): how the command-line tools, and the ranks they
#: start, see an algorithm that is not built in. Set it on every rank.
PLUGINS_ENV = "COLLTUNE_ALGORITHMS"


def plugin_modules() -> tuple[str, ...]:
    """Return the modules :data:`PLUGINS_ENV` names, in order."""
    return tuple(m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip())


def _import_plugin(module: str) -> None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever the module raised, say which variable named it
        raise ColltuneValueError(
            f"{PLUGINS_ENV} names module {module!r}, which could not be imported ({type(exc).__name__}: "
            f"{exc}); put the module on the Python path of every rank, or fix the variable.",
            argument="environment",
        ) from exc


def _load_builtins() -> None:
    global _loaded, _loading
    if _loaded or _loading:
        return
    with _lock:
        if _loaded or _loading:
            return
        _loading = True
        try:
            for module in BUILTIN_MODULES:
                importlib.import_module(module)
            for module in plugin_modules():
                _import_plugin(module)
        finally:
            _loading = False
        _loaded = True


def _reorder() -> None:
    """Recompute the names' order: built-ins in their fixed order whichever was imported first, then the rest."""
    global _names
    order = list(_registry)
    rank = {m: i for i, m in enumerate(BUILTIN_MODULES)}
    _names = tuple(sorted(order, key=lambda n: (rank.get(type(_registry[n]).__module__, len(rank)), order.index(n))))


def register(algorithm: A) -> A:
    """Register an algorithm (an instance, or a class with a no-argument constructor) under its ``name``.

    Usable as a class decorator. Every rank must register the same
    algorithms in the same order before the first call that may use them.

    Raises:
        ColltuneTypeError: ``algorithm`` is not an :class:`Algorithm`.
        ColltuneValueError: its name is empty, reserved, or taken by another algorithm.
    """
    from colltune.algorithms.base import Algorithm

    _load_builtins()  # a name is taken by a built-in even before the built-ins are first read
    instance = algorithm() if isinstance(algorithm, type) else algorithm
    if not isinstance(instance, Algorithm):
        raise ColltuneTypeError(
            f"register() takes an Algorithm subclass or instance, but got {type(instance).__name__}.",
            argument="algorithm",
        )
    name = getattr(instance, "name", None)
    if not isinstance(name, str) or not name.isidentifier() or name in RESERVED:
        raise ColltuneValueError(
            f"an algorithm's name must be an identifier other than {', '.join(RESERVED)}, but got {name!r}.",
            argument="algorithm",
        )
    with _lock:
        known = _registry.get(name)
        if known is not None and type(known) is not type(instance):
            raise ColltuneValueError(
                f"algorithm name {name!r} is taken by {type(known).__name__}; choose another name.",
                argument="algorithm",
            )
        _registry[name] = instance
        _reorder()
    return algorithm


def unregister(name: str) -> None:
    """Remove the algorithm registered as ``name`` (a no-op for unknown names)."""
    with _lock:
        _registry.pop(name, None)
        _reorder()


def names() -> tuple[str, ...]:
    """Return the names of the registered algorithms, built-ins first, in registration order.

    Before anything is registered and with no plugin named, these are the
    built-ins' names, known without importing them (nor torch).
    """
    if not _loaded and not plugin_modules():
        return BUILTIN_NAMES
    _load_builtins()
    return _names


def knob_specs(name: str) -> tuple["Knob", ...]:
    """Return the knobs of the algorithm registered as ``name`` (no torch needed: see :mod:`colltune.algorithms.lazy`).

    Raises:
        ColltuneValueError: ``name`` is not registered; the message lists the known names.
    """
    return tuple(get(name).knob_specs)


def get(name: str) -> "Algorithm":
    """Return the algorithm registered as ``name``.

    Raises:
        ColltuneValueError: ``name`` is not registered; the message lists the known names.
    """
    _load_builtins()
    try:
        return _registry[name]
    except (KeyError, TypeError):
        raise ColltuneValueError(
            f"algorithm must be one of {', '.join(_registry)} (or 'auto'), but got {name!r}.",
            argument="algorithm",
        ) from None
