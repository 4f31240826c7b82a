"""`python -m spmd_grpo.tools.synthetic_data make-geo3k OUT.parquet [--rows N] [--seed S]`: synthetic
geometry3k-schema rows (`spmd_grpo.data.synthetic`) written to a parquet file."""

from __future__ import annotations

import argparse
from pathlib import Path

from spmd_grpo.data.synthetic import synthetic_geo3k_rows, write_parquet


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m spmd_grpo.tools.synthetic_data", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-geo3k", help="write synthetic geometry3k-schema rows to a parquet file")
    make.add_argument("out", type=Path)
    make.add_argument("--rows", type=int, default=64)
    make.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.rows <= 0:
        parser.error("--rows must be positive")
    path = write_parquet(synthetic_geo3k_rows(args.rows, args.seed), args.out)
    print(f"wrote {args.rows} rows to {path}")


if __name__ == "__main__":
    main()
