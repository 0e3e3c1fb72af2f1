"""What the data plane's command lines share."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the flag (no usage block): that line is what
    `kubectl logs` shows for a crash-looping pod."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
