"""Key patterns (torch-free, so ``fqnckpt inspect`` can name a layout without importing torch):
literal text with placeholders, ``{i}`` one name segment (``[^.]+``), ``{name:REGEX}`` a custom
regex, ``{*e}`` a gathered index (digits). Used by :mod:`checkpoint.convert.rules` and
:mod:`checkpoint.layout_versions`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

PLACEHOLDER = re.compile(r"\{(\*?)([A-Za-z_]\w*)(?::((?:[^{}]|\{\d*,?\d*\})+))?\}")


@dataclass(frozen=True)
class Pattern:
    """One key pattern (see the module docstring). ``gathered`` names its ``{*x}`` wildcard."""

    text: str

    @cached_property
    def _parsed(self) -> tuple[re.Pattern, tuple[str, ...], str | None]:
        out, names, gathered, pos = [], [], None, 0
        for m in PLACEHOLDER.finditer(self.text):
            out.append(re.escape(self.text[pos : m.start()]))
            star, name, rx = m.groups()
            if name in names:
                raise ValueError(f"pattern {self.text!r}: placeholder {{{name}}} used twice")
            if star:
                if gathered is not None:
                    raise ValueError(f"pattern {self.text!r}: more than one gathered placeholder")
                gathered, rx = name, r"\d+"
            out.append(f"(?P<{name}>{rx or '[^.]+'})")
            names.append(name)
            pos = m.end()
        out.append(re.escape(self.text[pos:]))
        return re.compile("".join(out)), tuple(names), gathered

    @property
    def regex(self) -> re.Pattern:
        return self._parsed[0]

    @property
    def names(self) -> tuple[str, ...]:
        return self._parsed[1]

    @property
    def gathered(self) -> str | None:
        return self._parsed[2]

    def match(self, key: str) -> dict[str, str] | None:
        m = self.regex.fullmatch(key)
        return None if m is None else m.groupdict()

    def format(self, values: dict[str, str], index: int | None = None) -> str:
        """The key for ``values`` (and ``index`` for the gathered placeholder)."""

        def sub(m: re.Match) -> str:
            star, name, _ = m.groups()
            if star:
                if index is None:
                    raise ValueError(f"pattern {self.text!r} needs an index for {{*{name}}}")
                return str(index)
            if name not in values:
                raise ValueError(f"pattern {self.text!r}: no value for {{{name}}} from the source key")
            return values[name]

        return PLACEHOLDER.sub(sub, self.text)


__all__ = ["Pattern", "PLACEHOLDER"]
