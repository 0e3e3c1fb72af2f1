"""``python -m maru_operator`` and the ``maru-operator`` console script."""

import sys

from maru_operator.cli import main

if __name__ == "__main__":
    sys.exit(main())
