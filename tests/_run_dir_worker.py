"""Worker for test_each_rank_trains_in_rank_0s_folder, started by torchrun: each rank asks `train` for a folder of its
own (as two ranks that start in different seconds name runs/NAME-TIMESTAMP differently) and prints the one it got.

usage: _run_dir_worker.py WORK_DIR SETTING...
"""
import os
import sys

from topoclip.config import load_config
from topoclip.run.training.trainer import train

work, settings = sys.argv[1], sys.argv[2:]
rank = os.environ["RANK"]
run_dir = train(load_config("tiny", settings), out_dir=f"{work}/rank{rank}", progress=False)
print(f"rank {rank} trained in {run_dir}")
