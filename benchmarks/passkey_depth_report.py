"""Merge the saved runs of `kvforge eval kv-evict --passkey-lengths ... --save PREFIX` into one table and plot.

On a shared machine each length runs best as its own process (`--passkey-lengths 4096 --save A`,
`--passkey-lengths 8184 --save B`); this puts their lengths side by side:

    python benchmarks/passkey_depth_report.py A.json B.json --save benchmarks/results/DATE_passkey_depth_length_MODEL
"""
from __future__ import annotations

import argparse
import json

from kvforge.evaluation.passkey_depth import merge_results, render_depth_table, save_depth_plot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="PREFIX.json files written by --save")
    ap.add_argument("--save", default=None, metavar="PREFIX", help="write PREFIX.txt, PREFIX.json, PREFIX.png")
    ap.add_argument("--note", default="", help="a line appended to the table (how and where it was measured)")
    args = ap.parse_args()
    saved = [json.load(open(path)) for path in args.runs]
    result = merge_results(saved)
    table = render_depth_table(result, saved[0]["model"]) + (f"\n\n{args.note}" if args.note else "")
    print(table)
    if args.save:
        with open(args.save + ".txt", "w") as f:
            f.write(table + "\n")
        with open(args.save + ".json", "w") as f:
            json.dump({"model": saved[0]["model"], "dtype": saved[0]["dtype"], "note": args.note,
                       **result.to_dict()}, f, indent=2)
        save_depth_plot(result, args.save + ".png")


if __name__ == "__main__":
    main()
