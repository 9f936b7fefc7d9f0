"""Bounded safe YAML loading for profiles and policies.

Profiles and policies come from other people's clusters, so reading one must
take bounded time and memory whatever it holds. A safe loader alone is not
enough: nested aliases (the "billion laughs" structure ``b: &b [*a, *a, ...]``)
let a file of a few hundred bytes stand for billions of values, which the
callers then walk, copy and hash; a recursive alias (``a: &a [*a]``) stands
for an endless one; and brackets nested some 20,000 deep overflow the C stack
in libyaml's composer and kill the process.

:func:`compose` builds the node graph (where an alias is one shared node, so
composing is linear in the text), refusing more than :data:`MAX_NODES` nodes
as it goes, and :func:`check_graph` walks it *as expanded*, before any Python
object is constructed, refusing:

- more than :data:`MAX_ALIAS_NODES` nodes repeated through aliases;
- collections nested more than :data:`MAX_DEPTH` deep (which also stops a
  recursive alias).

:func:`read_bytes` and :func:`check_text` refuse input over :data:`MAX_BYTES`
before it is parsed. Bytes alone do not bound the work: PyYAML spends some
400 bytes and several microseconds on each node, and a text can write one
node per byte (``[0,0,...]``), so it is :data:`MAX_NODES` that keeps a load
within seconds and about 100 MiB. Every refusal is a :class:`YamlLimitError`;
the callers re-raise it as their own error class with the file name.

Loading stays code-free: only safe loaders are used (no Python tags, nothing
is ever instantiated). :func:`load` keeps the speed of ``yaml.CSafeLoader``.

Example:
    >>> load("a: &a [1, 2]\\nb: *a\\n")
    {'a': [1, 2], 'b': [1, 2]}
"""

from __future__ import annotations

import os
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode
from yaml.resolver import Resolver

__all__ = [
    "MAX_BYTES",
    "MAX_NODES",
    "MAX_ALIAS_NODES",
    "MAX_DEPTH",
    "YamlLimitError",
    "read_bytes",
    "check_text",
    "check_graph",
    "compose",
    "node_bound",
    "load",
]

#: Largest file or text accepted, in bytes. The largest shipped profiles
#: (profiles/cpu-gloo.yaml and cpu-gloo-grid.yaml, about 3,000 measurements
#: each) are 1.2 MB; 16 MiB is 13 times that, some 40,000 measurements, which a profile reads without YAML
#: (see :func:`colltune.model.profile.load_profile`). Refused before any byte is read.
MAX_BYTES = 16 * 1024 * 1024
#: Most nodes a document may write (every scalar, sequence and mapping, keys
#: included; an alias counts once here, its value against
#: :data:`MAX_ALIAS_NODES`). Composing, checking and constructing cost about
#: 400 bytes and 3 to 15 microseconds a node (deep nesting costs most), so this
#: many take at most a second or two and about 100 MiB; 16 MiB of ``[0,0,...]``
#: would be 8 million nodes, 60 s and 3 GiB. Colltune's own YAML is far under
#: it: a policy or a profile's head holds a few thousand nodes, and a
#: profile's measurements in the layout colltune writes are not read as YAML.
MAX_NODES = 100_000
#: Most nodes that aliases may repeat (every use of an alias counts the whole
#: value it names). No shipped file uses aliases, a policy's ``<<: *defaults``
#: repeats a few nodes per rule, and the callers walk 100,000 in well under a
#: second; 9 levels of 9-fold aliases (720 bytes) would be 387 million.
MAX_ALIAS_NODES = 100_000
#: Deepest nesting of collections. Colltune files nest about 5 levels; the
#: callers (and PyYAML's Python composer, near 330) recurse per level.
MAX_DEPTH = 100
#: Nesting that libyaml's composer (yaml.CSafeLoader) surely survives: it
#: recurses in C per level and overflows an 8 MiB stack past about 20,000.
_C_SAFE_DEPTH = 10_000


class YamlLimitError(ValueError):
    """Input over one of this module's limits; callers re-raise it as their own error.

    Attributes:
        problem: what was found and the limit.
        fix: what to do about it.
        line: 1-based line where the limit was crossed, or ``None``.
        limit: which limit: ``"bytes"``, ``"nodes"``, ``"aliases"`` or ``"depth"``.
    """

    def __init__(self, problem: str, fix: str, line: int | None = None, *, limit: str = "") -> None:
        self.problem = problem
        self.fix = fix
        self.line = line
        self.limit = limit
        where = "" if line is None else f"line {line}: "
        super().__init__(f"{where}{problem}; {fix}")


def _too_deep(line: int | None, recursive: bool = False) -> YamlLimitError:
    problem = f"collections nested more than {MAX_DEPTH} deep"
    if recursive:
        problem += " through aliases (an alias inside the collection it names, a recursive structure, nests without end)"
    return YamlLimitError(problem, "write the structure out flat; colltune files nest a few levels", line, limit="depth")


def _line(node: Node) -> int | None:
    return None if node.start_mark is None else node.start_mark.line + 1


def check_graph(root: Node) -> None:
    """Refuse a composed document whose aliases repeat too much or that nests too deep.

    The walk visits the graph as it would be expanded (an aliased collection
    once per use) and stops at the first limit crossed, so it costs at most the
    nodes written plus :data:`MAX_ALIAS_NODES`: milliseconds for a profile.

    Args:
        root: the document's root node, from :func:`compose`.

    Raises:
        YamlLimitError: aliases repeat more than :data:`MAX_ALIAS_NODES`
            nodes, or collections nest more than :data:`MAX_DEPTH` deep; the
            line is where the repeated or deepest value is written.
    """
    if isinstance(root, ScalarNode):
        return
    seen: set[int] = set()  # collections visited; a second visit comes through an alias
    repeated = 0
    # (collection, its depth, the collection whose repeat it is part of or None)
    stack: list[tuple[Node, int, Node | None]] = [(root, 1, None)]
    while stack:
        node, depth, origin = stack.pop()
        if origin is None and id(node) in seen:
            origin = node
            repeated += 1  # the collection itself; its children are counted below
        seen.add(id(node))
        if isinstance(node, MappingNode):
            count = 2 * len(node.value)
            nested = [n for pair in node.value for n in pair if not isinstance(n, ScalarNode)]
        else:
            count = len(node.value)
            nested = [n for n in node.value if not isinstance(n, ScalarNode)]
        if origin is not None:
            repeated += count
            if repeated > MAX_ALIAS_NODES:
                raise YamlLimitError(
                    f"aliases repeat more than {MAX_ALIAS_NODES:,} nodes, the limit (the value at this line "
                    "is one of those repeated)",
                    "write repeated values out instead of nesting aliases: every use of an alias counts "
                    "the whole value it names, so aliases of aliases multiply",
                    _line(origin),
                    limit="aliases",
                )
        if nested:
            if depth >= MAX_DEPTH:
                raise _too_deep(_line(nested[0]), recursive=origin is not None)
            # Reversed, so the walk meets values in file order and reports the first.
            stack.extend([(n, depth + 1, origin) for n in reversed(nested)])


def _too_many(line: int | None) -> YamlLimitError:
    return YamlLimitError(
        f"more than {MAX_NODES:,} values (YAML nodes: scalars, lists and mappings, keys included), the limit "
        "(the value at this line is past it)",
        "check that this is the right file: colltune's own files hold a few thousand",
        line,
        limit="nodes",
    )


def _count_nodes(loader: Composer) -> None:
    """Make ``loader`` refuse its node past :data:`MAX_NODES` as it composes, before building more."""
    compose_node = loader.compose_node
    count = 0

    def counted(parent: Node | None, index: Any) -> Node:
        nonlocal count
        count += 1
        if count > MAX_NODES:
            event = loader.peek_event()
            raise _too_many(None if event.start_mark is None else event.start_mark.line + 1)
        return compose_node(parent, index)

    setattr(loader, "compose_node", counted)  # this instance only; the class keeps its method


def compose(loader: Any) -> Node | None:
    """Compose ``loader``'s single document and check it with :func:`check_graph`.

    A loader with PyYAML's Python composer (``yaml.SafeLoader`` and its
    subclasses) stops at node :data:`MAX_NODES` + 1; libyaml's composer
    (``yaml.CSafeLoader``) cannot be stopped, so :func:`load` gives it only
    text that cannot hold more (see :func:`node_bound`).

    Args:
        loader: a safe loader instance holding the text (``yaml.SafeLoader``
            or a subclass, ``yaml.CSafeLoader``, ...).

    Returns:
        The root node, or ``None`` for an empty document.

    Raises:
        YamlLimitError: the document is over a limit of this module.
        yaml.YAMLError: the text is not valid YAML.
    """
    if isinstance(loader, Composer):
        _count_nodes(loader)
    try:
        root = loader.get_single_node()
    except RecursionError:
        # PyYAML's Python composer recurses per level; far past MAX_DEPTH.
        raise _too_deep(None) from None
    except yaml.YAMLError:
        text = getattr(loader, "deep_text", None)
        if text is None:
            raise
        # libyaml's parser refuses deep nesting by a limit of its own on some PyYAML releases (6.0.4):
        # parse in Python, which has none, so that this module's limit decides on every release.
        fallback = yaml.SafeLoader(text)
        _count_nodes(fallback)
        try:
            root = fallback.get_single_node()
        except RecursionError:
            raise _too_deep(None) from None
        finally:
            del fallback.compose_node
            fallback.dispose()
    finally:
        if isinstance(loader, Composer):
            del loader.compose_node  # the counter holds the loader: no cycle left behind
    if root is not None:
        check_graph(root)
    return root


def node_bound(text: str) -> int:
    """Return a bound on the nodes ``text`` can compose to, from its indicator characters.

    Every node but the root is a sequence entry, started by a ``-``, ``[``
    or ``,`` of its own, or the key or the value of a mapping pair, which has
    a ``:``, ``?``, ``{`` or ``,`` of its own; so each of these characters
    accounts for at most two nodes (``?`` alone is a mapping pair of an empty
    key and an empty value). Tight for nested block mappings, loose for text
    whose strings hold these characters; counting takes a few ms per MB.
    """
    return 1 + 2 * sum(text.count(c) for c in ",:-?[{")


try:
    from yaml._yaml import CParser  # libyaml's parser, what yaml.CSafeLoader uses
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    CParser = None

if CParser is not None:

    class _CEventLoader(Composer, CParser, SafeConstructor, Resolver):
        """libyaml's parser with PyYAML's Python composer, which fails cleanly when too deep."""

        def __init__(self, stream: str | bytes) -> None:
            self.deep_text = stream  # for compose's fallback when libyaml refuses the nesting itself
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)


_RUNS = str.maketrans(" \t?:-", "\0\0\0\0\0")


def _c_composer_safe(text: str) -> bool:
    """Whether ``text`` cannot nest deeper than libyaml's composer survives.

    A flow collection opens with ``[`` or ``{`` (a single-pair mapping in a
    flow sequence rides on its bracket: at most 2 levels a bracket), and a
    block collection starts in a line's indentation or after its leading
    ``-``, ``?`` and ``:`` indicators and their spaces or tabs (at most 2
    levels a column). Counting them takes a few ms per MB.
    """
    brackets = text.count("[") + text.count("{")
    run = _C_SAFE_DEPTH // 4
    return brackets < run and "\0" * run not in text.translate(_RUNS)


def _loader_for(text: str) -> Any:
    # yaml.CSafeLoader composes in C, about 1.5x as fast as the Python
    # composer on libyaml's events, but crashes on very deep nesting and
    # cannot be stopped at MAX_NODES: it gets only text that fits both.
    if CParser is None:  # pragma: no cover
        return yaml.SafeLoader(text)
    if node_bound(text) <= MAX_NODES and _c_composer_safe(text):
        return yaml.CSafeLoader(text)
    return _CEventLoader(text)


def _too_big(size: int | None, limit: int) -> YamlLimitError:
    found = "more than that" if size is None else f"{size:,} bytes"
    return YamlLimitError(
        f"the limit is {limit:,} bytes ({limit / 2**20:g} MiB), got {found}",
        "check that this is the right file: the largest shipped profile is under 1 MB",
        limit="bytes",
    )


def read_bytes(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """Read a whole file of at most ``limit`` bytes.

    Args:
        path: the file.
        limit: the most bytes accepted; ``None`` means :data:`MAX_BYTES`.

    Returns:
        The file's content.

    Raises:
        OSError: the file cannot be read.
        YamlLimitError: the file is larger than ``limit``; a regular file is
            refused before any of it is read.
    """
    limit = MAX_BYTES if limit is None else limit
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise _too_big(size, limit)
        # A pipe or device reports no size; reading one byte past the limit tells.
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise _too_big(None, limit)
    return data


def check_text(text: str, limit: int | None = None) -> None:
    """Refuse ``text`` whose UTF-8 encoding is longer than ``limit`` bytes (``None``: :data:`MAX_BYTES`).

    Raises:
        YamlLimitError: the text is too long.
    """
    limit = MAX_BYTES if limit is None else limit
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise _too_big(size, limit)


def load(text: str) -> Any:
    """Parse one YAML document with a safe loader, within this module's limits.

    Args:
        text: the YAML text.

    Returns:
        The document as plain Python data (``None`` for an empty one).

    Raises:
        YamlLimitError: the text is over a limit of this module.
        yaml.YAMLError: the text is not valid YAML for a safe loader.
    """
    check_text(text)
    loader = _loader_for(text)
    try:
        root = compose(loader)
        return None if root is None else loader.construct_document(root)
    finally:
        loader.dispose()
