#!/usr/bin/env python3
"""Re-run every example command of the book and put its real output in place.

A chapter marks an example with an HTML comment followed by a ```text block:

    <!-- run: schedc check ../shared/cases/05a-naive-1f1b-deadlock.case -->
    ```text
    $ schedc check ../shared/cases/05a-naive-1f1b-deadlock.case
    ...output...
    ```

The command runs under bash from the repository root, with `target/debug` first on PATH (so
`schedc` is the binary `cargo build -p schedc-cli` built), standard error merged into standard
output. The block is replaced by `$ <command>` and the output, exactly as printed.

    python3 book/refresh-examples.py          # rewrite the chapters
    python3 book/refresh-examples.py --check  # exit 1 if an example is out of date
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "book", "src")
MARK = re.compile(r"^<!-- run: (.*) -->$")


def run(cmd: str) -> str:
    env = dict(os.environ)
    env["PATH"] = os.path.join(ROOT, "target", "debug") + os.pathsep + env["PATH"]
    env.pop("CLICOLOR_FORCE", None)
    env["NO_COLOR"] = "1"
    p = subprocess.run(
        ["bash", "-c", cmd],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return p.stdout.rstrip("\n")


def refresh(path: str) -> bool:
    """Rewrites `path`; returns True if anything changed."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        m = MARK.match(line)
        i += 1
        if not m:
            continue
        cmd = m.group(1)
        # Drop the block that follows the marker, if any.
        if i < len(lines) and lines[i] == "```text":
            j = i + 1
            while j < len(lines) and lines[j] != "```":
                j += 1
            i = j + 1
        out.append("```text")
        out.append("$ " + cmd)
        body = run(cmd)
        if body:
            out.extend(body.split("\n"))
        out.append("```")
    new = "\n".join(out)
    with open(path, encoding="utf-8") as f:
        old = f.read()
    if new != old:
        if "--check" not in sys.argv:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
        return True
    return False


def main() -> int:
    changed = [
        name
        for name in sorted(os.listdir(SRC))
        if name.endswith(".md") and refresh(os.path.join(SRC, name))
    ]
    for name in changed:
        print(("out of date: " if "--check" in sys.argv else "updated: ") + name)
    return 1 if changed and "--check" in sys.argv else 0


if __name__ == "__main__":
    sys.exit(main())
