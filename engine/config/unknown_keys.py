"""Unknown keys in a configuration: every one a file holds, named in one error.

A config file is read section by section (the engine's top level, its nested groups, the
server's section), but a user who mistypes two keys should not restart once per typo: the
sections are checked together before any is built. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ditserve.engine.errors import ConfigError

# One section of a config: its data, the keys it may hold, its dotted path ("" at the top).
Section = tuple[Any, Collection[str], str]


def reject_unknown_keys(data: Any, known: Collection[str], path: str = "") -> None:
    """A config mapping may only hold ``known`` keys; the error names the others."""
    reject_unknown_sections([(data, known, path)])


def reject_unknown_sections(sections: Sequence[Section]) -> None:
    """Every section may only hold its known keys; one error names all the others."""
    unknown: dict[str, tuple[list[str], Collection[str]]] = {}
    for data, known, path in sections:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
        names = sorted(str(k) for k in set(data) - set(known))
        if names:
            unknown[path] = (names, known)
    if len(unknown) == 1:
        ((path, (names, known)),) = unknown.items()
        where = f" in {path}" if path else ""
        raise ConfigError(
            f"unknown option(s){where}: {', '.join(names)}; known: {', '.join(sorted(known))}")
    if unknown:
        dotted = [f"{path}.{n}" if path else n for path, (names, _) in unknown.items()
                  for n in names]
        known_lines = [f"known {f'in {path}' if path else 'at the top level'}: "
                       f"{', '.join(sorted(known))}" for path, (_, known) in unknown.items()]
        raise ConfigError(f"unknown option(s): {', '.join(dotted)}; " + "; ".join(known_lines))
