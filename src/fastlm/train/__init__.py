"""Training the language model: `fastlm train` and `python -m fastlm.train` (the module torchrun
starts once per GPU).

    config.py      TrainConfig: every setting, typed, with its default and help; the parser is built from it
    loop.py        the training loop and the command's entry points
    checkpoint.py  what a checkpoint holds, and what OUT must hold to start or resume a run
    log.py         the log lines, log.jsonl, loss.png, and the files of a run in OUT

It imports the model, ops, optimizers, data, distributed runtime and `fastlm.utils`, nothing of the
benchmark framework (tests/test_cli_imports.py holds it to that). Importing the package loads
nothing: the command line builds its parser from `config` without torch.
"""
