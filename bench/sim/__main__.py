"""`python -m bench.sim`: see bench/sim/cli.py."""

from bench.sim.cli import main

raise SystemExit(main())
