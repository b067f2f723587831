"""`topoclip train ARGS...` that also writes, for every step, the keys of the samples it trained on.

usage: _stream_run.py KEYS.jsonl TOPOCLIP-TRAIN-ARGS...   (tests/test_resume_stream.py kills it with SIGKILL)

Each batch's keys are appended (flushed) as {"step": S, "keys": [...]} when the trainer takes it; on a CPU
batches are not prefetched, so the batch taken as step S is the one trained at step S.
"""
import json
import sys

from topoclip.cli import main
from topoclip.run.training import trainer

original = trainer.training_batches


def logged(config, start_step, *args, **kwargs):
    with open(sys.argv[1], "a", encoding="utf-8") as keys_file:
        for step, batch in enumerate(original(config, start_step, *args, **kwargs), start=start_step + 1):
            keys_file.write(json.dumps({"step": step, "keys": batch.keys}) + "\n")
            keys_file.flush()
            yield batch


if __name__ == "__main__":  # (a DataLoader worker started by a fork server imports this module again)
    trainer.training_batches = logged
    sys.exit(main(["train", *sys.argv[2:]]))
