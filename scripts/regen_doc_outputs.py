"""Regenerate the command outputs the documents show, so none is typed by hand.

    python scripts/regen_doc_outputs.py [--check] [DOC ...]

A document marks an output block with the command that writes it, on the line before the
fence::

    <!-- output of: vshape plan --model gpt-9.6b --gpus 16 --gpu-memory 80 -->
    ```
    ...what the command prints...
    ```

A command whose output is Markdown itself (a table) is marked without a fence, up to an end
mark::

    <!-- markdown output of: vshape features -->
    | setting | ... |
    <!-- end of output -->

This script runs each marked command (in this process, through ``megatron_vshape.cli.main``,
without progress output) and writes its standard output into the block. ``--check`` changes
nothing and exits 1 when a block differs from what its command prints now, apart from the
planner's own run time ("in 2.3 s"), which differs from run to run; tests/docs/test_doc_outputs.py
runs it that way. Default documents: every docs/*.md that has a marked block.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"^<!-- output of: (vshape .+?) -->\n```[a-z]*\n(.*?)```$", re.M | re.S)
MARKDOWN_MARK = re.compile(r"^<!-- markdown output of: (vshape .+?) -->\n(.*?)<!-- end of output -->$",
                           re.M | re.S)
_RUN_TIME = re.compile(r" in \d+(\.\d+)? s\b")


def run(command: str) -> str:
    """What ``command`` (a ``vshape`` command line) prints on standard output."""
    from megatron_vshape.cli import main

    argv = shlex.split(command)[1:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv + (["--no-progress"] if argv[0] in ("plan",) else []))
    if code not in (0, 1):
        raise SystemExit(f"{command!r} failed with exit status {code}")
    return out.getvalue()


def comparable(text: str) -> str:
    """``text`` without what changes from run to run (the planner's run time)."""
    return _RUN_TIME.sub(" in N s", text)


def regenerate(doc: Path, check: bool) -> list[str]:
    """Rewrite (or, with ``check``, compare) ``doc``'s marked blocks; the stale commands."""
    text = doc.read_text()
    stale = []

    def replace_with(end: str):
        def replace(match: re.Match) -> str:
            command, shown = match.group(1), match.group(2)
            printed = run(command)
            if comparable(printed) != comparable(shown):
                stale.append(command)
            head = match.group(0)[:match.start(2) - match.start(0)]
            return head + printed + end
        return replace

    new = MARKDOWN_MARK.sub(replace_with("<!-- end of output -->"), text)
    new = MARK.sub(replace_with("```"), new)
    if not check and new != text:
        doc.write_text(new)
    return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("docs", nargs="*", type=Path,
                        help="documents (default: every docs/*.md with a marked block)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when a block is stale")
    args = parser.parse_args()
    docs = args.docs or sorted(p for p in (ROOT / "docs").glob("*.md")
                               if MARK.search(p.read_text()) or
                               MARKDOWN_MARK.search(p.read_text()))
    stale = {str(doc): regenerate(doc, args.check) for doc in docs}
    for doc, commands in stale.items():
        for command in commands:
            verb = "stale" if args.check else "regenerated"
            print(f"{doc}: {verb}: {command}", file=sys.stderr)
    return 1 if args.check and any(stale.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
