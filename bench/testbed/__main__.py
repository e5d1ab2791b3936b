"""`python -m bench.testbed up|down|status` (the same as `cpn testbed ...`)."""

from api.cli.testbed import main

main()
