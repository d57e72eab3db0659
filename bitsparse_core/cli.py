"""Command line: ``bitsparse demo`` (also ``python -m bitsparse_core demo``)."""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bitsparse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="pack ReLU-like tensors, check round trips, show ratios")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main
        return demo_main()
    return 2
