"""`python -m fastlm ...` is the same as the `fastlm` console script."""

from fastlm.cli import main

raise SystemExit(main())
