#!/usr/bin/env python3
"""Prints the executable cargo built for a target, from `cargo ... --message-format=json` on stdin.

Usage: cargo test --no-run --message-format=json ... | python3 scripts/lib/cargo-exe.py NAME [KIND]
NAME is the target's name (a test file's stem, or the crate name for its unit tests); KIND (e.g.
`test`, `lib`, `bin`) narrows it. Prints nothing if no such artifact was built.
"""
import json
import sys

name = sys.argv[1]
kind = sys.argv[2] if len(sys.argv) > 2 else None
found = None
for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    target = msg.get("target", {})
    if (msg.get("reason") == "compiler-artifact" and msg.get("executable")
            and target.get("name") == name and (kind is None or kind in target.get("kind", []))):
        found = msg["executable"]
if found:
    print(found)
