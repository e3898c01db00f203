"""The training loop of `fastlm train` in one process (tiny preset, tests/data/corpus.txt; on the GPU
it learns and writes its log and plot; gradient accumulation, the learning-rate schedule and
clipping do what they say; an interrupted run resumes on the same tokens, bit for bit."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fastlm import checkpoint
from fastlm.data.tokens import EpochOrder, Windows
from fastlm.layers.linear import linear_weights
from fastlm.model import ModelConfig, TransformerLM
from fastlm.optim.schedule import warmup_cosine_lr
from fastlm.train import loop, memory_fit
from fastlm.train.config import TrainConfig
from fastlm.train.log import read_log
from fastlm.utils import host_memory
from fastlm.utils.errors import UserError

SMALL = ["--preset", "tiny", "--context", "16", "--log-every", "1", "--eval-sequences", "4"]


def _run(corpus_data, out, *argv) -> list[dict]:
    assert loop.main(["--data", str(corpus_data), *SMALL, "--out", str(out), *argv]) == 0
    return read_log(out / "log.jsonl")


def test_training_learns_and_writes_its_log(corpus_data, tmp_path, capsys):
    records = _run(
        corpus_data,
        tmp_path,
        "--context",
        "32",
        "--micro-batch",
        "8",
        "--steps",
        "40",
        "--warmup",
        "4",
        "--lr",
        "3e-3",
        "--log-every",
        "10",
        "--eval-every",
        "20",
        "--eval-sequences",
        "16",
    )
    assert [r["step"] for r in records] == [0, 10, 20, 30, 40]
    assert [("eval_loss" in r) for r in records] == [True, False, True, False, True]
    assert records[-1]["eval_loss"] < 0.6 * records[0]["eval_loss"]  # from ln(320) = 5.8 (the padded vocabulary)
    assert records[-1]["loss"] < 0.6 * records[1]["loss"]
    for record in records[1:]:
        assert record["tokens"] == record["step"] * 8 * 32 and record["tokens_per_s"] > 0 and record["grad_norm"] > 0
        if torch.cuda.is_available():
            assert record["mfu"] > 0 and record["peak_memory_gib"] > 0
        else:
            assert record["mfu"] is None and record["peak_memory_gib"] is None
    out = capsys.readouterr().out
    assert "step 20/40 | loss " in out and " | eval loss " in out and "checkpoint step 40: " in out
    assert (tmp_path / "loss.png").stat().st_size > 0
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["config"]["vocab_size"] == 320 and (run["gpu"] == "cpu") != torch.cuda.is_available()
    assert run["bucket_mb"] is None  # one process has no buckets


def _weights(out) -> dict:
    return checkpoint.load(out / "checkpoints").state["model"]


def test_accumulation_matches_one_large_batch(corpus_data, tmp_path):
    # 4 windows a step: one micro-batch of 4, or 2 of 2 whose gradients add up
    whole = _run(corpus_data, tmp_path / "whole", "--micro-batch", "4", "--steps", "3")
    halves = _run(corpus_data, tmp_path / "halves", "--micro-batch", "2", "--batch-tokens", "64", "--steps", "3")
    # the sums run in another order (GPU reductions: last bits)
    torch.testing.assert_close([r["loss"] for r in halves[1:]], [r["loss"] for r in whole[1:]], rtol=1e-5, atol=0)
    reference = _weights(tmp_path / "whole")
    for name, value in _weights(tmp_path / "halves").items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5, msg=name)


def test_learning_rate_follows_the_schedule(corpus_data, tmp_path):
    records = _run(
        corpus_data,
        tmp_path,
        "--micro-batch",
        "2",
        "--steps",
        "6",
        "--warmup",
        "2",
        "--lr",
        "1e-3",
        "--min-lr-ratio",
        "0.2",
        "--checkpoint-every",
        "0",
    )
    expected = [warmup_cosine_lr(step, lr=1e-3, min_lr=2e-4, warmup=2, steps=6) for step in range(6)]
    assert [r["lr"] for r in records[1:]] == pytest.approx(expected)


def _norm(tensors) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])).item()


@pytest.mark.parametrize("precision", ["fp32", "bf16-weights"])
@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_gradient_clipping(corpus_data, tmp_path, clip, precision):
    # after one AdamW step the first moment is (1 - beta1) x the gradient it was given: the clipped
    # one (bf16 gradients: clipped by their norm taken in fp32; a norm in bf16 would be 0.1% off)
    records = _run(
        corpus_data, tmp_path, "--micro-batch", "2", "--steps", "1", "--grad-clip", str(clip), "--precision", precision
    )
    state = checkpoint.load(tmp_path / "checkpoints").state["optimizer"]["state"]
    first_moment = _norm([s["exp_avg"] for s in state.values()])
    norm = records[1]["grad_norm"]  # before clipping
    assert norm > 0.05
    assert first_moment == pytest.approx((1 - loop.BETAS[0]) * (min(norm, clip) if clip else norm), rel=1e-4)


def _untimed(records: list[dict]) -> list[dict]:
    """Every logged number but the timings, which differ from run to run."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "elapsed_s")} for r in records]


def test_bf16_weights_train_as_bf16_autocast_does(corpus_data, tmp_path):
    # the forward sees the same bf16 weights either way: the same first losses; then fastlm's AdamW
    # updates fp32 masters with the bf16 gradients autocast would have cast to fp32
    argv = ["--micro-batch", "2", "--steps", "4", "--lr", "3e-3", "--warmup", "0"]
    autocast = _run(corpus_data, tmp_path / "autocast", *argv, "--precision", "bf16")
    stored = _run(corpus_data, tmp_path / "stored", *argv, "--precision", "bf16-weights")
    assert stored[0]["eval_loss"] == autocast[0]["eval_loss"] and stored[1]["loss"] == autocast[1]["loss"]
    torch.testing.assert_close([r["loss"] for r in stored[1:]], [r["loss"] for r in autocast[1:]], rtol=2e-3, atol=0)
    state = checkpoint.load(tmp_path / "stored" / "checkpoints").state
    weights, optimizer = state["model"], state["optimizer"]
    model = TransformerLM(ModelConfig.preset("tiny"))
    low = {id(p) for p in linear_weights(model)}
    linear = [name for name, p in model.named_parameters() if id(p) in low]  # in the optimizer's order
    assert all(weights[name].dtype == torch.bfloat16 for name in linear)
    assert all(value.dtype == torch.float32 for name, value in weights.items() if name not in linear)
    masters = [optimizer["state"][i]["master"] for i in optimizer["param_groups"][0]["params"]]
    reference = _weights(tmp_path / "autocast")
    for name, master in zip(linear, masters, strict=True):
        assert torch.equal(weights[name], master.to(torch.bfloat16)), name
        # each of the 4 updates moves a weight by up to lr = 3e-3; a weight whose bf16 rounding flips sees
        # other gradients from then on
        difference = (master - reference[name]).abs()
        assert difference.max() < 1e-3 and difference.mean() < 2e-5, name


def test_precision_cannot_change_to_or_from_bf16_weights_on_resume(corpus_data, tmp_path, capsys):
    argv = ["--micro-batch", "2", "--steps", "1"]
    _run(corpus_data, tmp_path, *argv, "--precision", "bf16")
    for overrides in ([], ["--override", "steps", "--override", "precision"]):  # the same answer either way
        resume = ["--steps", "2", "--resume", *overrides]
        assert (
            loop.main(
                [
                    "--data",
                    str(corpus_data),
                    *SMALL,
                    "--out",
                    str(tmp_path),
                    *argv,
                    *resume,
                    "--precision",
                    "bf16-weights",
                ]
            )
            == 2
        )
        assert "cannot change to or from bf16-weights" in capsys.readouterr().err


def test_a_run_resumes_with_the_other_kernel_set(corpus_data, tmp_path, capsys):
    # every kernel switch (rope too) follows --kernels, which --override kernels lets change
    argv = ["--micro-batch", "2", "--steps", "1"]
    _run(corpus_data, tmp_path, *argv, "--kernels", "torch")
    assert "no GPU: --kernels fastlm" not in capsys.readouterr().out
    records = _run(
        corpus_data,
        tmp_path,
        *argv,
        "--steps",
        "2",
        "--resume",
        "--override",
        "steps",
        "--override",
        "kernels",
        "--kernels",
        "fastlm",
    )
    assert records[-1]["step"] == 2
    assert loop.CPU_FASTLM_KERNELS in capsys.readouterr().out  # the CPU runs the reference paths, slower


class _Interrupted(Exception):
    pass


def test_interrupted_run_resumes_on_the_same_tokens(corpus_data, tmp_path, monkeypatch):
    argv = ["--micro-batch", "2", "--steps", "5", "--warmup", "2", "--checkpoint-every", "2"]
    straight = _run(corpus_data, tmp_path / "straight", *argv)
    save = loop.save_checkpoint

    def save_then_stop(args, step, *rest, **kwargs):  # the process dies right after committing step 2
        save(args, step, *rest, **kwargs)
        if step == 2:
            raise _Interrupted

    monkeypatch.setattr(loop, "save_checkpoint", save_then_stop)
    with pytest.raises(_Interrupted):
        _run(corpus_data, tmp_path / "interrupted", *argv)
    monkeypatch.undo()
    assert checkpoint.load(tmp_path / "interrupted" / "checkpoints").state["data"] == {"position": 2 * 2}
    resumed = _run(corpus_data, tmp_path / "interrupted", *argv, "--resume")
    assert _untimed(resumed) == _untimed(straight)
    reference = checkpoint.load(tmp_path / "straight" / "checkpoints").state
    final = checkpoint.load(tmp_path / "interrupted" / "checkpoints").state
    assert final["data"] == reference["data"] == {"position": 5 * 2}
    for name, value in final["model"].items():
        assert torch.equal(value, reference["model"][name]), name


def test_ranks_take_contiguous_shares_of_one_global_batch():
    windows = Windows([np.arange(1000)], context=4, vocab_size=1000)
    order = EpochOrder(windows.count, seed=0)

    def steps(world: int, rank: int, micro_batch: int) -> list[np.ndarray]:
        accumulation = 8 // (micro_batch * world)
        batches = loop.micro_batches(windows, order, 10, micro_batch, accumulation, rank, world, torch.device("cpu"))
        return [torch.cat([next(batches)[0] for _ in range(accumulation)]).numpy() for _ in range(2)]

    one = steps(world=1, rank=0, micro_batch=2)
    for world, micro_batch in ((2, 2), (4, 1), (2, 4)):
        shares = [steps(world, rank, micro_batch) for rank in range(world)]
        for step in range(2):
            np.testing.assert_array_equal(np.concatenate([share[step] for share in shares]), one[step])
    expected = windows[order.ids(18, 8)][:, :-1]  # the second step starts 8 windows later
    np.testing.assert_array_equal(one[1], expected)


@pytest.mark.parametrize(
    ("asked", "micro_batch", "world", "windows", "expected"),
    [(64, 8, 2, 100, 64), (64, 16, 8, 1000, 128), (64, 8, 3, 100, 48), (5, 2, 1, 100, 4), (64, 8, 1, 30, 24)],
)
def test_evaluation_takes_whole_global_batches_at_least_one(asked, micro_batch, world, windows, expected):
    held_out = Windows([np.arange(windows * 4 + 1)], context=4, vocab_size=windows * 4 + 1)
    assert held_out.count == windows
    config = TrainConfig(data=Path("d"), eval_sequences=asked, micro_batch=micro_batch)
    assert loop.evaluation_windows(held_out, config, world) == expected


def test_evaluation_needs_one_global_batch_of_held_out_windows():
    held_out = Windows([np.arange(30 * 4 + 1)], context=4, vocab_size=121)
    with pytest.raises(UserError, match="30 window.* fewer than --micro-batch x processes = 32"):
        loop.evaluation_windows(held_out, TrainConfig(data=Path("d"), micro_batch=8), 4)


def test_running_out_of_memory_is_one_line_that_names_fsdp(corpus_data, tmp_path, capsys, monkeypatch):
    """A step that runs out of device memory (simulated: the allocator's error from the gradient
    clipping) ends the run with one sentence that points to --parallel fsdp; under fsdp itself, to
    a smaller batch."""

    def out_of_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(loop, "_clip_gradients", out_of_memory)
    argv = ["--data", str(corpus_data), *SMALL, "--micro-batch", "4", "--out", str(tmp_path), "--steps", "2"]
    assert loop.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert error.startswith("python -m fastlm.train: error: out of memory (CUDA out of memory. Tried to allocate")
    assert "with --parallel none each process holds 0.0 GB" in error and "--parallel fsdp shards all of it" in error
    config = loop.parse_args([*argv, "--parallel", "fsdp"])
    oom = torch.OutOfMemoryError("CUDA out of memory")
    message = memory_fit.out_of_memory_message(config, {"vocab_size": 257}, 1, oom)
    assert message == (
        "out of memory (CUDA out of memory) with --parallel fsdp at --micro-batch 4 x --context 16: "
        "use a smaller --micro-batch or --context"
    )


def test_model_inputs_carry_documents_only_where_a_row_holds_a_boundary():
    rows = np.array([[5, 1, 2, 3, 4], [7, 8, 9, 1, 2]])  # windows of context 4 + 1
    tokens, targets = loop.model_inputs(rows, 60, torch.device("cpu"))  # no boundary id inside: plain rows
    assert torch.equal(tokens, torch.from_numpy(rows[:, :-1])) and torch.equal(targets, torch.from_numpy(rows[:, 1:]))
    rows[1, 2] = 60  # a document starts inside row 1's tokens
    tokens, targets, bounds = loop.model_inputs(rows, 60, torch.device("cpu"))
    assert bounds[:4].tolist() == [0, 4, 6, 8]
    rows[1, 2], rows[0, 4] = 3, 60  # a boundary as row 0's last target starts no document among its tokens
    assert len(loop.model_inputs(rows, 60, torch.device("cpu"))) == 2
    assert len(loop.model_inputs(rows, None, torch.device("cpu"))) == 2


def test_each_padded_document_count_gets_a_static_graph():
    """The cumulative lengths' size is static under torch.compile: a graph per padded count (64, 128,
    256 documents here), never one over a dynamic size (which torch 2.11's Inductor fails to build
    around the attention kernels)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(lambda lengths: lengths.sum(), backend=counter, fullgraph=True)
    torch._dynamo.reset()
    for documents in (3, 70, 200):  # padded to 64, 128, 256
        rows = np.zeros((1, 301), dtype=np.int64)
        rows[0, 1 : documents * 1 : 1] = 60  # a boundary on each of the first tokens
        *_, bounds = loop.model_inputs(rows, 60, torch.device("cpu"))
        compiled(bounds)
    assert counter.frame_count == 3


@pytest.mark.parametrize(
    ("extra", "bytes_per_parameter"),
    [([], 16), (["--shard-optimizer"], 8 + 8 / 2), (["--precision", "bf16-weights"], 16)],
)
def test_out_of_memory_message_counts_what_each_process_holds(corpus_data, extra, bytes_per_parameter):
    argv = ["--data", str(corpus_data), "--preset", "small", "--parallel", "ddp", *extra]
    config = loop.parse_args(argv)
    parameters = config.model_config(257).num_parameters()
    oom = torch.OutOfMemoryError("CUDA out of memory")
    message = memory_fit.out_of_memory_message(config, {"vocab_size": 257}, 2, oom)
    assert f"each process holds {parameters * bytes_per_parameter / 1e9:.1f} GB of weights" in message, message


def test_a_replicated_model_whose_state_exceeds_the_gpu_is_refused(corpus_data):
    argv = ["--data", str(corpus_data), "--preset", "small", "--parallel", "ddp"]
    config = loop.parse_args(argv)
    parameters = config.model_config(257).num_parameters()
    state = parameters * 16  # fp32 weights and gradients, AdamW's two moments
    memory_fit.check_state_fits(config, {"vocab_size": 257}, 2, capacity=state)  # fits exactly: goes on
    with pytest.raises(UserError) as caught:
        memory_fit.check_state_fits(config, {"vocab_size": 257}, 2, capacity=state - 1)
    assert str(caught.value) == (
        f"with --parallel ddp each process would hold {state / 1e9:.1f} GB of weights, gradients and AdamW state "
        f"({parameters / 1e9:.2f}B parameters), more than the GPU's {(state - 1) / 1e9:.1f} GB; use --parallel "
        "fsdp, which shards all of it across processes (torchrun) or --shard-optimizer, or a smaller model"
    )
    sharded = loop.parse_args([*argv, "--shard-optimizer"])  # already sharded: not suggested again
    with pytest.raises(UserError, match=r"\(torchrun\), or a smaller model$"):
        memory_fit.check_state_fits(sharded, {"vocab_size": 257}, 2, capacity=1)
    fsdp = loop.parse_args([*argv[:-1], "fsdp"])  # sharded: its state is divided, not checked here
    memory_fit.check_state_fits(fsdp, {"vocab_size": 257}, 2, capacity=1)


def test_training_on_a_cpu_stops_before_building_a_model_the_host_cannot_hold(
    corpus_data, tmp_path, capsys, monkeypatch
):
    """`fastlm train --preset 10b` on a CPU: one line before anything is built (it would swap for
    minutes, then be killed); the state counted is every process's on this host."""
    monkeypatch.setattr(host_memory, "host_memory", lambda: 64 * 10**9)
    monkeypatch.setattr(loop, "_setup", lambda config: torch.device("cpu"))  # also on a GPU machine

    def loop_must_not_run(*_):
        raise AssertionError("the training loop ran")

    monkeypatch.setattr(loop, "_train_loop", loop_must_not_run)
    argv = ["--data", str(corpus_data), *SMALL, "--preset", "10b", "--micro-batch", "4", "--out", str(tmp_path / "run")]
    assert loop.main(argv) == 2
    parameters = loop.parse_args(["--data", "d", "--preset", "10b"]).model_config(257).num_parameters()
    billions, gb = parameters / 1e9, 16 * parameters / 1e9
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            f"on a CPU, the training state of 1 process(es) (weights, gradients and AdamW moments of {billions:.2f}B "
            f"parameters) needs about {gb:.1f} GB, more than half of the 64.0 GB here; use a smaller model (--preset, "
            "--d-model, --layers) or fewer processes"
        )
    )
    config = loop.parse_args(["--data", "d", "--preset", "small", "--parallel", "fsdp"])
    small = config.model_config(257).num_parameters()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four processes on this host, each with a quarter of the state
    monkeypatch.setattr(host_memory, "host_memory", lambda: 2 * 16 * small)
    memory_fit.check_state_fits_host(config, {"vocab_size": 257}, 4)  # all of it: fits the budget exactly
    monkeypatch.setattr(host_memory, "host_memory", lambda: 2 * 16 * small - 2)
    with pytest.raises(UserError, match=r"of 4 process\(es\)"):
        memory_fit.check_state_fits_host(config, {"vocab_size": 257}, 4)


def test_training_stops_before_building_a_model_the_gpu_cannot_hold(corpus_data, tmp_path, capsys, monkeypatch):
    """On a GPU (simulated: a 1 GB device) the check runs before the model is built: one line, and
    nothing of the loop runs."""

    class SmallGPU:
        total_memory = 10**9

    def loop_must_not_run(*_):
        raise AssertionError("the training loop ran")

    monkeypatch.setattr(loop, "_setup", lambda config: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SmallGPU())
    monkeypatch.setattr(loop, "_train_loop", loop_must_not_run)
    argv = ["--data", str(corpus_data), *SMALL, "--preset", "small", "--micro-batch", "4", "--steps", "2"]
    argv += ["--out", str(tmp_path / "run")]
    assert loop.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert "with --parallel none each process would hold" in error and "more than the GPU's 1.0 GB" in error


@pytest.mark.parametrize("bucket_mb", [[], ["--bucket-mb", "0.001"]], ids=["one-unit", "a-unit-per-block"])
def test_fsdp_compiles_the_blocks_as_one_graph_where_they_are_one_unit(bucket_mb, monkeypatch, tmp_path):
    """The tiny model's blocks fit the default unit size: the stack's forward is compiled and
    replaced by the compiled one (FSDP's hooks stay outside the graph); in units of one block, each
    block is compiled."""
    compiled = {}  # what was compiled -> what the compile returned

    def compile(fn, **_):
        compiled[fn] = lambda *args, **kwargs: fn(*args, **kwargs)
        return compiled[fn]

    monkeypatch.setattr(torch, "compile", compile)
    monkeypatch.setenv("RANK", "0")  # as torchrun sets them
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = loop.parse_args(
        ["--data", str(tmp_path), *SMALL, "--parallel", "fsdp", "--compile", "compile", *bucket_mb]
    )
    model = TransformerLM(config.model_config(257))
    loop._compile(model, config)
    assert [fn.__self__ for fn in compiled] == (list(model.blocks) if bucket_mb else [model.blocks])
    if not bucket_mb:
        assert model.blocks.forward is next(iter(compiled.values()))


@pytest.mark.parametrize(("compile_mode", "expected"), [("eager", 25.0), ("compile", 500.0)])
def test_bucketed_takes_one_large_bucket_when_the_model_is_one_graph(compile_mode, expected):
    """Compiled, all gradients reach bucketed's hooks at the end of backward: its default buckets are
    large (fewer all-reduce calls); eager, small ones overlap the backward."""
    config = TrainConfig(data=Path("d"), parallel="bucketed", compile=compile_mode).resolved(gpu=False)
    assert config.parallel_spec().bucket_mb == expected
    given = dataclasses.replace(config, bucket_mb=7.0)
    assert given.parallel_spec().bucket_mb == 7.0
