"""What every subcommand shares: the :class:`Command` base, argument types, output checks.

Argument types raise ``argparse.ArgumentTypeError`` with the option's
expected form, so ``colltune X --n foo`` fails with one line naming it.

Every ``--help`` imports this module, so it loads no NumPy and no torch.
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import json
import os
import sys
from typing import Any, ClassVar

from colltune.algorithms.errors import ColltuneError, ColltuneValueError
from colltune.model.files import write_text_atomic


class UsageError(ColltuneError, ValueError):
    """A command-line option has a bad value (exit status 2)."""


class Command(abc.ABC):
    """One ``colltune`` subcommand.

    :meth:`add_arguments` is called once when the parser is built;
    :meth:`run` is called with the parsed options when the subcommand is
    chosen, and returns the exit status. It raises :class:`UsageError` for
    option values the parser could not check.
    """

    name: ClassVar[str]
    help: ClassVar[str]

    @abc.abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this command's options to ``parser``."""

    @abc.abstractmethod
    def run(self, args: argparse.Namespace) -> int:
        """Run the command; return the exit status."""


def parse_n(text: str, scientific: bool = False) -> int:
    """Parse ``1048576``, ``2^20`` or ``2**20`` (and ``1e6`` when ``scientific``)."""
    t = text.strip().replace("**", "^")
    try:
        if "^" in t:
            base, exp = t.split("^", 1)
            value = int(base) ** int(exp)
        else:
            value = int(float(t)) if scientific and "e" in t.lower() else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer such as 1048576 or 2^20, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def number_type(convert: Any, ok: Any, expected: str, must: str, name: str, scale: float = 1.0) -> Any:
    """Return an argparse ``type``: ``convert(text)`` checked by ``ok(value)``.

    A text ``convert`` rejects gives "expected EXPECTED, got 'TEXT'"; a value
    ``ok`` rejects gives "must be MUST, got 'TEXT'". A value that passes is
    multiplied by ``scale`` when that is not 1.
    """

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}")
        return value if scale == 1.0 else value * scale

    parse.__name__ = parse.__qualname__ = name
    return parse


parse_world = number_type(int, lambda v: v >= 1, "an integer >= 1", ">= 1 (the number of ranks)", "parse_world")


#: The most ranks the cost model prices: :data:`colltune.model.features.MAX_WORLD_SIZE`, stated here so that
#: ``--help`` needs no NumPy (a test checks that the two agree).
MAX_WORLD_SIZE = 2**31 - 1

#: :data:`MAX_WORLD_SIZE` as ``--help`` and the errors state it.
WORLD_BOUND = f"at most {MAX_WORLD_SIZE} (2^31 - 1, the most ranks torch.distributed and NCCL can count)"


#: Ranks the cost model prices (``simulate`` and ``explain``: world sizes, nodes, ranks per node).
parse_priced_ranks = number_type(int, lambda v: 1 <= v <= MAX_WORLD_SIZE, "an integer >= 1",
                                 f">= 1 and {WORLD_BOUND}", "parse_priced_ranks")


parse_positive_int = number_type(int, lambda v: v >= 1, "an integer >= 1", ">= 1", "parse_positive_int")


parse_nonneg_int = number_type(int, lambda v: v >= 0, "an integer >= 0", ">= 0", "parse_nonneg_int")


parse_density = number_type(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1] such as 1e-3",
                              "in (0, 1] (entries per rank over n)", "parse_density")


parse_overlap = number_type(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]",
                              "in [0, 1] (0: disjoint index sets, 1: identical)", "parse_overlap")


parse_seconds = number_type(float, lambda v: v > 0, "a number of seconds > 0", "> 0 seconds", "parse_seconds")


def check_writable(path: str) -> None:
    """Raise :class:`UsageError` unless ``path`` can be written (checked before a long run)."""
    if os.path.isdir(path):
        raise UsageError(f"--json {path!r} is a directory; pass a file name such as "
                         f"{os.path.join(path, 'bench.json')!r}.")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"--json {path!r} cannot be written ({exc.strerror}); "
                         "pass a path in a writable directory.") from None
    if not existed:
        os.remove(path)


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (NumPy scalars and arrays as numbers and lists)."""
    write_text_atomic(path, json.dumps(obj, indent=1, default=_json_default) + "\n")


def save_json(path: str | None, obj: Any) -> None:
    """:func:`write_json` ``obj`` to ``path`` and say so on standard output; nothing without a path."""
    if path:
        write_json(path, obj)
        print(f"wrote {path}")


def _json_default(o: Any) -> Any:
    if type(o).__module__ != "numpy":
        raise TypeError(f"not JSON serializable: {type(o).__name__}")
    import numpy as np  # loaded already: ``o`` is one of its objects

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def cluster_profile(args: argparse.Namespace) -> tuple[Any, str, bool]:
    """Return the profile of ``--profile`` (else ``--backend``'s) with the cluster options applied, its label,
    and whether an option changed it.

    The cluster options are ``--gpu``, ``--gpus-per-node`` and ``--nic-gbps``;
    they describe an NCCL cluster (``colltune simulate``, ``colltune explain``).
    """
    from colltune.model.profile import load_profile
    from colltune.select.selector import shipped_profile

    path = args.profile or shipped_profile(args.backend)
    if path is None:
        raise UsageError(f"no profile is shipped for --backend {args.backend}; pass --profile FILE")
    profile = load_profile(path)
    changes = {"gpu": args.gpu, "ranks_per_node": args.gpus_per_node, "nic_gbps": args.nic_gbps}
    changes = {k: v for k, v in changes.items() if v is not None}
    if changes and profile.meta.get("backend") != "nccl":
        raise UsageError(f"--gpu, --gpus-per-node and --nic-gbps describe an NCCL cluster, but {path} is a "
                         f"{profile.meta.get('backend')} profile; pass --backend nccl or an NCCL --profile")
    if changes:
        if "gpu" in changes:
            from colltune.model.nccl import Topology

            try:
                Topology(1, 1, changes["gpu"])
            except ColltuneValueError as exc:
                raise UsageError(f"--gpu: {exc}") from None
        profile = dataclasses.replace(profile, meta={**profile.meta, **changes})
    return profile, os.path.basename(str(path)), bool(changes)


def discard_stdout() -> None:
    """Point standard output at ``os.devnull``, so the interpreter's last flush of it cannot fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a stream with no descriptor
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def say(*lines: str) -> None:
    """Print ``lines`` to standard output; a reader that left (``| head -1``) ends the printing, not the run.

    For commands whose work goes on after they print (``bench`` still
    writes its report): the rest of the output goes to ``os.devnull``.
    """
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        discard_stdout()
