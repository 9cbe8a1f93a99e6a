"""`python -m tevjax` and the `tevjax` console script."""

from tevjax.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
