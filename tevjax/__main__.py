"""`python -m tevjax` and the `tevjax` console script."""

import sys

from tevjax import cli


def main() -> int:
    """The console script's entry: the CLI, ended at once on a Ctrl-C that may have stopped JAX
    mid-compile (`cli.main`'s `exit_at_once`)."""
    return cli.main(sys.argv[1:], exit_at_once=True)


if __name__ == "__main__":
    raise SystemExit(main())
