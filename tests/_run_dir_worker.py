"""Worker for test_each_rank_trains_in_rank_0s_folder, started by torchrun: each rank asks `train` for a folder of its
own (as two ranks that start in different seconds name runs/NAME-TIMESTAMP differently) and writes the one it got to
WORK_DIR.rankN (a file each: two ranks printing at once may interleave their lines in torchrun's stdout).

usage: _run_dir_worker.py WORK_DIR SETTING...
"""
import os
import sys
from pathlib import Path

from topoclip.config import load_config
from topoclip.run.training.trainer import train

work, settings = sys.argv[1], sys.argv[2:]
rank = os.environ["RANK"]
run_dir = train(load_config("tiny", settings), out_dir=f"{work}/rank{rank}", progress=False)
Path(f"{work}.rank{rank}").write_text(str(run_dir))
