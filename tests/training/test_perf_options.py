"""Speed options that must not change results: bucketed padding trim, a fixed context under torch.compile,
device-side step skipping and its counts, worker-side tokenisation, and the settings that turn them on."""
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from topoclip.config import load_config
from topoclip.data.batch import RawBatch
from topoclip.model.clip import CLIP
from topoclip.model.text import LENGTH_BUCKET, trimmed_length
from topoclip.preprocess.tokenizer import TextBatch, Tokenizer
from topoclip.run.training.optim import build_optimizer
from topoclip.run.training.guard import SkippedSteps
from topoclip.run.training.step import forward_backward_loss, nonfinite_anywhere, optimizer_step, process_settings
from topoclip.run.training.trainer import train

from _tolerance import TINY, fp32_pair, model_roundings


def captions_of_lengths(config, lengths: list[int]) -> TextBatch:
    """Random ids with texts of the given real lengths, padded to the context (B, L)."""
    context = config.text.context_length
    ids = torch.randint(5, config.text.vocab_size, (len(lengths), context))
    ids[:, 0] = config.text.cls_token_id
    mask = torch.arange(context)[None, :] < torch.tensor(lengths)[:, None]
    return TextBatch(ids.masked_fill(~mask, 0), mask)


@pytest.mark.parametrize("longest, context, expected", [(3, 32, 8), (8, 32, 8), (9, 32, 16), (30, 32, 32),
                                                         (10, 12, 12), (0, 32, 8), (2, 5, 5)])
def test_trimmed_length_rounds_up_to_a_bucket_within_the_context(longest, context, expected):
    mask = torch.zeros(3, context, dtype=torch.bool)
    mask[1, :longest] = True
    assert trimmed_length(mask, bucket=LENGTH_BUCKET) == expected
    assert trimmed_length(mask) == max(1, longest)  # on a CPU: exact


@pytest.mark.parametrize("pooling", ["class_tokens", "end_of_text"])
def test_the_bucketed_trim_equals_the_full_context_in_fp32(pooling):
    overrides = [] if pooling == "class_tokens" else ["model.text.pooling=end_of_text", "model.text.attention=causal"]
    config = load_config("tiny", overrides).model
    model = CLIP(config).eval()
    text = captions_of_lengths(config, [3, 11, 5, 7])
    if pooling == "end_of_text":  # the end-of-text token is the largest id, at the text's last position
        text.input_ids[torch.arange(4), text.attention_mask.sum(1) - 1] = config.text.vocab_size - 1
    with torch.no_grad():
        trimmed = model.text(text.input_ids, text.attention_mask)  # 11 of the context's columns
        full = model.text.encode_tokens(text.input_ids, text.attention_mask, padded=True)
    assert trimmed_length(text.attention_mask) < config.text.context_length
    # fewer (masked) columns change the length of the attention sums: two fp32 orders of the same values
    torch.testing.assert_close(trimmed, full, **fp32_pair(model_roundings(TINY, 1), float(full.abs().max())))


def test_compiled_text_tower_has_no_graph_break_and_one_graph_for_all_lengths():
    config = load_config("tiny").model
    model = CLIP(config).eval()
    explanation = torch._dynamo.explain(model.text)(*vars(captions_of_lengths(config, [3, 9])).values())
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    with torch.no_grad():
        for lengths in ([3, 4], [17, 2], [9, 30], [5, 5]):  # 4, 17, 30, 5 columns in eager mode
            text = captions_of_lengths(config, lengths)
            got = compiled(text=text).text_embeds
            torch.testing.assert_close(got, model(text=text).text_embeds, **fp32_pair(model_roundings(TINY, 2)))
    assert counter.frame_count == 1  # compiled once: no recompilation across caption lengths
    torch._dynamo.reset()


def test_compiled_training_step_compiles_once_across_caption_lengths():
    config = load_config("tiny")
    model = CLIP(config.model)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    for lengths in ([3, 4, 6, 2], [17, 2, 9, 30]):
        loss = forward_backward_loss(compiled, torch.randn(4, 3, 32, 32), captions_of_lengths(config.model, lengths))
        assert loss.shape == () and math.isfinite(float(loss))
    assert counter.frame_count == 1
    torch._dynamo.reset()


def step_with(skip: float):
    config = load_config("tiny")
    model = CLIP(config.model)
    optimizer = build_optimizer(model, config.train)
    text = captions_of_lengths(config.model, [4, 6])
    forward_backward_loss(model, torch.randn(2, 3, 32, 32), text)
    before = [p.detach().clone() for p in model.parameters()]
    norm = optimizer_step(model, optimizer, None, 1.0, skip=torch.tensor(skip))
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return norm, changed, model


def test_a_skipped_step_leaves_the_weights_and_an_unskipped_one_updates():
    norm, changed, model = step_with(1.0)
    assert not changed and math.isnan(float(norm))
    assert all(p.grad is None for p in model.parameters())  # the skipped step's gradients are dropped
    norm, changed, _ = step_with(0.0)
    assert changed and math.isfinite(float(norm)) and float(norm) > 0


def test_skipped_steps_are_counted_on_the_device_and_read_on_demand():
    skips = SkippedSteps(torch.device("cpu"))
    for loss in (1.0, float("nan"), float("inf"), 2.0, float("nan")):
        skips.record(nonfinite_anywhere(torch.tensor(loss)))
    assert skips.read() == (1, 2, 3)  # 1 in a row now, longest run 2, 3 in all
    skips.record(nonfinite_anywhere(torch.tensor(float("nan"))))
    assert skips.read() == (2, 2, 4)  # the run goes on across reads
    skips.record(nonfinite_anywhere(torch.tensor(0.5)))
    assert skips.read() == (0, 2, 4)


def test_perf_settings_have_defaults_and_the_cpu_optimizer_is_not_fused():
    config = load_config("tiny")
    assert config.train.allow_tf32 is True and config.train.fused_optimizer is True
    optimizer = build_optimizer(CLIP(config.model), config.train)
    assert not optimizer.defaults.get("fused")  # fused kernels only for CUDA weights
    off = load_config("tiny", ["train.allow_tf32=false", "train.fused_optimizer=false"]).train
    assert off.allow_tf32 is False and off.fused_optimizer is False


def test_user_data_batches_arrive_tokenized_by_the_loader_workers(tmp_path):
    from topoclip.data.shard_writer import write_shards
    from topoclip.run.training.data import training_batches

    captions = [f"a photo number {i} of a {'red' if i % 2 else 'blue'} thing" for i in range(16)]
    images = [torch.randint(0, 255, (24, 24, 3), dtype=torch.uint8).numpy() for _ in captions]
    write_shards(zip(images, captions), tmp_path / "shards", samples_per_shard=8)
    config = load_config("tiny", ["data.source=shards", f"data.train_data={tmp_path / 'shards'}/{{00000..00001}}.tar",
                                  "train.batch_size=4", "train.num_workers=2", "data.shuffle_buffer=4"])
    tokenizer = Tokenizer.train(captions, vocab_size=200, context_length=config.model.text.context_length)
    batches = training_batches(config, 0, tokenizer=tokenizer)
    for _ in range(5):
        batch = next(batches)
        assert isinstance(batch, RawBatch) and batch.text is not None
        expected = tokenizer(batch.captions)
        assert torch.equal(batch.text.input_ids, expected.input_ids)
        assert torch.equal(batch.text.attention_mask, expected.attention_mask)
        assert batch.text.input_ids.shape == (4, config.model.text.context_length)  # one shape: no recompile


def test_process_settings_are_restored_after_the_block_and_after_an_error():
    before = (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with pytest.raises(RuntimeError):
        with process_settings(1, tf32=not before[1]):
            assert torch.get_num_threads() == 1
            assert torch.backends.cuda.matmul.allow_tf32 is torch.backends.cudnn.allow_tf32 is (not before[1])
            raise RuntimeError
    assert (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_a_training_run_leaves_the_callers_threads_as_they_were(tmp_path):
    # train.threads is the run's own: a notebook or test that trains keeps its thread count (and on a GPU its
    # TF32 flags, which the same process_settings block restores; the GPU check found them leaking).
    before = torch.get_num_threads()
    threads = 1 if before != 1 else 2
    settings = ["train.num_workers=0", "train.steps=1", "evaluate.size=48", "data.scenes.train_size=256",
                "data.scenes.val_size=64", "data.scenes.test_size=64", f"train.threads={threads}"]
    train(load_config("tiny", settings), out_dir=tmp_path / "run", progress=False)
    assert torch.get_num_threads() == before
