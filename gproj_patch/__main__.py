"""Command line: ``python -m gproj_patch COMMAND``.

Commands:
  ``audit``    attention-gradient errors of every backend (and of your own functions) vs an fp64 oracle
               (``gproj_patch.audit.cli`` documents the options, metrics and JSON fields);
  ``startup``  ``--check`` / ``--install [DIR]`` / ``--uninstall [DIR]``: the ``GPROJ_PATCH=1`` start-up hook
               (``gproj_patch.integrations.startup``; called in-process, so no runpy warning).
``--version`` prints the package version.
"""
from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["startup"]:  # its own parser, options passed through unchanged
        # before the audit's import, which imports torch: checking the hook must not set it off (with
        # GPROJ_PATCH=1 the hook enables the patch at torch's import) nor pay for torch
        from .integrations import startup
        return startup.main(argv[1:], prog="python -m gproj_patch startup")
    from .version import __version__
    from .audit import cli as audit

    parser = audit.OneLineParser(prog="python -m gproj_patch",
                                     description="gproj_patch: correct BF16/FP16 attention gradients (GProj)")
    parser.add_argument("--version", action="version", version=f"gproj_patch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=audit.OneLineParser)
    sub.required = True
    ap = sub.add_parser("audit", help="gradient error of every attention backend on the adversarial suite")
    audit.build_parser(ap)
    sub.add_parser("startup", add_help=False,
                   help="--check | --install [DIR] | --uninstall [DIR]: the GPROJ_PATCH=1 start-up hook")
    args = parser.parse_args(argv)
    if args.command == "audit":
        return audit.run_audit(args, ap)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
