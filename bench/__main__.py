"""`python -m xlaserve.bench ...` == `xlaserve bench ...`."""

from xlaserve.bench.cli import main

if __name__ == "__main__":
    main()
