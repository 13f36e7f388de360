"""Command line: ``python -m gproj_patch audit [--quick] [--json PATH] [--plot PATH.png] ...``.

Subcommands: ``audit`` (see ``gproj_patch.audit.cli`` for the options, metrics and the JSON fields).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from .audit import cli as audit

    parser = argparse.ArgumentParser(prog="python -m gproj_patch",
                                     description="gproj_patch: correct BF16/FP16 attention gradients (GProj)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    ap = sub.add_parser("audit", help="gradient error of every attention backend on the synthetic suite",
                        description=audit.__doc__.split("\n\n")[0])
    audit.build_parser(ap)
    args = parser.parse_args(argv)
    if args.command == "audit":
        return audit.run_audit(args, ap)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
