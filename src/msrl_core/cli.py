"""The ``msrl`` command line: ``msrl info`` prints the runtime backends and the build."""

from __future__ import annotations

import argparse
import json
import sys

from msrl_core import __version__
from msrl_core.runtime import runtime_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="msrl", description="msrl_core command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the available device backends and the one in use (JSON)")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(json.dumps({"msrl_core": __version__, **runtime_info()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
