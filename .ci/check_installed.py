"""Exit 1, naming each, when an installed distribution differs from its pin in a constraints file (the versions the
suite passed with); 0 when every pinned distribution that is installed has its pinned version.

    python .ci/check_installed.py constraints.txt

Pins of distributions that are not installed are fine (the main job installs fewer than the test extra); a pin is
``name==version`` on a line of its own, ``#`` starts a comment."""

from __future__ import annotations

import re
import sys
from importlib import metadata


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def pins(path: str) -> dict[str, str]:
    found = {}
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;=]+)", line)
        if match is None:
            sys.exit(f"{path}:{number}: not a pin (name==version): {line!r}")
        found[canonical(match.group(1))] = match.group(2)
    return found


def main(path: str) -> int:
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
    wrong = [
        f"{name} {installed[name]} is installed, {path} pins {version}"
        for name, version in sorted(pins(path).items())
        if name in installed and installed[name] != version
    ]
    for line in wrong:
        print(f"check_installed: {line}", file=sys.stderr)
    if wrong:
        print(f"check_installed: install with `pip install -c {path} ...` (docs/install.md)", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "constraints.txt"))
