"""`darkbloom` for tests that spawn a real node process with a test backend passed in.

    python -m tests.support.node_main [--first-token-delay SECONDS] [--direct-fail STATUS] serve ARGS…

runs the real CLI (`darkbloom serve ARGS…`: the same options, config and node), except that the node
gets the backend its config names wrapped in `FirstTokenDelayBackend`, and with `--direct-fail` a
`FailingBackend` for direct mode. Run it from the repository root (`tests` must be importable).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Sequence

from darkbloom import cli
from darkbloom.provider import runner
from darkbloom.provider.backends import Backend, create_backend
from darkbloom.provider.config import ProviderConfig
from tests.support.backends import FailingBackend, FirstTokenDelayBackend


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--first-token-delay must be a number of seconds, not {text!r}") from None
    if not 0 <= value < math.inf:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"--first-token-delay must be a finite number of seconds ≥ 0, not {text!r}")
    return value


def error_status(text: str) -> int:
    if not text.isdigit() or not 400 <= int(text) <= 599:
        raise argparse.ArgumentTypeError(f"--direct-fail must be an HTTP error status (400-599), not {text!r}")
    return int(text)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.support.node_main")
    parser.add_argument("--first-token-delay", type=seconds, default=0.0)
    parser.add_argument("--direct-fail", type=error_status, default=None)
    parser.add_argument("cli_args", nargs=argparse.REMAINDER, help="darkbloom's own arguments")
    return parser.parse_args(argv)


def node_backend(config: ProviderConfig, first_token_delay: float) -> Backend:
    backend = create_backend(config)
    return FirstTokenDelayBackend(backend, first_token_delay) if first_token_delay > 0 else backend


def main(argv: Sequence[str] | None = None) -> None:
    options = parse(argv)
    serve_forever = runner.serve_forever

    def serve_with_test_backends(config: ProviderConfig, home: Path, local_only: bool = False) -> None:
        direct = FailingBackend(options.direct_fail) if options.direct_fail is not None else None
        serve_forever(config, home, local_only, backend=node_backend(config, options.first_token_delay),
                      direct_backend=direct)

    runner.serve_forever = serve_with_test_backends  # what `darkbloom serve` calls once it has the config
    cli.app(args=options.cli_args, prog_name="darkbloom")


if __name__ == "__main__":
    main()
