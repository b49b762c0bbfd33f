"""`python -m bench`: see bench/README.md."""

from bench.runner import main

raise SystemExit(main())
