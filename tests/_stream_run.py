"""`topoclip train ARGS...` that also writes, for every step, the keys of the samples it trained on.

usage: _stream_run.py KEYS.jsonl TOPOCLIP-TRAIN-ARGS...   (tests/test_resume_stream.py kills it with SIGKILL)

Each batch's keys are appended (flushed) as {"step": S, "keys": [...]} when the trainer takes it; on a CPU
batches are not prefetched, so the batch taken as step S is the one trained at step S.
"""
import json
import sys

from topoclip.cli import main
from topoclip.training import trainer

keys_file = open(sys.argv[1], "a", encoding="utf-8")
original = trainer.training_batches


def logged(config, start_step, *args, **kwargs):
    for step, batch in enumerate(original(config, start_step, *args, **kwargs), start=start_step + 1):
        keys_file.write(json.dumps({"step": step, "keys": batch.keys}) + "\n")
        keys_file.flush()
        yield batch


trainer.training_batches = logged
sys.exit(main(["train", *sys.argv[2:]]))
