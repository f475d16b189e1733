"""Selecting which linear layers a method touches, by name patterns.

Patterns are shell globs on module paths (``*q_proj``, ``model.layers.0.*``) or
regular expressions prefixed with ``re:``. A target pattern that matches no layer is
an error: a typo must not silently quantize nothing.
"""
from __future__ import annotations

import fnmatch
import re

from torch import nn

from compress.config import ConfigError


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def select_linears(model: nn.Module, targets: list[str], ignore: list[str],
                   where: str = "") -> list[tuple[str, nn.Linear]]:
    """Linear modules matching any of ``targets`` and none of ``ignore``, in model order."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for key, patterns in (("targets", targets), ("ignore", ignore)):
        for p in patterns:
            if not any(_matches(n, p) for n, _ in linears):
                raise ConfigError(f"pattern {p!r} matches no linear layer "
                                  f"(layers look like {linears[0][0] if linears else 'none'!r})",
                                  f"{where}.{key}" if where else key)
    chosen = [(n, m) for n, m in linears
              if any(_matches(n, p) for p in targets) and not any(_matches(n, p) for p in ignore)]
    if not chosen:
        raise ConfigError("targets select no layer once ignore is applied", f"{where}.targets" if where else "targets")
    return chosen
