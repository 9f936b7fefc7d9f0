"""Print the README's knob table, generated from the algorithm registry.

Usage: python3 tools/knob_table.py

Every registered algorithm's knobs (``Algorithm.knob_specs``) in registry
order; tests/test_registry.py checks that the README holds exactly this table.
"""

from __future__ import annotations

from colltune import algorithms


def _default(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"`{value}`"
    return repr(value)


def knob_table() -> str:
    """Return the knob table as Markdown."""
    lines = ["| algorithm | knob | default | meaning |", "| --- | --- | --- | --- |"]
    for name in algorithms.names():
        for knob in algorithms.get(name).knob_specs:
            lines.append(f"| `{name}` | `{knob.name}` | {_default(knob.default)} | {knob.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(knob_table(), end="")
