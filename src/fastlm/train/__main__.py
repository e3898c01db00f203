"""`python -m fastlm.train ...`: the same as `fastlm train ...`, the module torchrun starts per GPU."""

from fastlm.distributed.launch import exit_process
from fastlm.train.loop import main

exit_process(main())  # not sys.exit: see exit_process
