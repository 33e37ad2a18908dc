"""What the tests look for in a captured console: the known harmless lines
(`common.noise.KNOWN_NOISE`) that the filter should have dropped."""

from __future__ import annotations

import re

from common.noise import KNOWN_NOISE


def noise_lines(output: str) -> list[str]:
    """The lines of a captured console that are known noise (what the filter should drop)."""
    return [
        line
        for line in output.splitlines()
        if any(re.search(noise.pattern, line) for noise in KNOWN_NOISE)
    ]
