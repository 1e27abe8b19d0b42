"""Small lab maintenance commands: `python3 lab/cli.py down-stale` removes leftovers of crashed runs."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lab import topo  # noqa: E402


def main():
    if sys.argv[1:] == ["down-stale"]:
        removed = topo.down_stale()
        print(f"removed {len(removed)} stale lab namespaces" + (f": {' '.join(removed)}" if removed else ""))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
