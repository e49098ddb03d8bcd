"""`python -m gpuportal.cli`, the same as the `gpuportal` console script."""

from gpuportal.cli.app import main

raise SystemExit(main())
