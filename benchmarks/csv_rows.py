"""What a CSV caption table's rows cost a DataLoader worker: Python strings against PackedRows (topoclip.data.csv).

    python benchmarks/csv_rows.py --rows 1000000 --workers 2 --out docs/results/csv-rows.json

Writes a table of --rows rows (paths like "shard-00042/000123456.jpg", captions of 40-120 characters) and reads it
once. For each way of holding the rows, as read_caption_table returns them (a list of str tuples) and as CsvDataset
keeps them (PackedRows, packed as the file is read), it prints: the memory the rows take in the process and the most
that reading them took; what a worker started from a fork
server (under torch.distributed) receives, its size and the time to pickle and unpickle it; and what each of
--workers forked workers copies when it reads every row once (its private dirty memory, from
/proc/PID/smaps_rollup, Linux): a str's reference count is written when it is read, so its page is copied.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

from topoclip.data.csv import CaptionTable, PackedRows, read_caption_table

WORDS = "a the red small large dog cat tree house on under near blue green striped photo of with two three".split()


def write_table(path: Path, rows: int) -> None:
    generator = random.Random(0)
    with open(path, "w", encoding="utf-8") as file:
        file.write("filepath,title\n")
        for index in range(rows):
            caption = " ".join(generator.choice(WORDS) for _ in range(generator.randint(8, 24)))
            file.write(f"shard-{index // 10_000:05d}/{index:09d}.jpg,{caption}\n")


def private_dirty_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1])
    raise RuntimeError("no Private_Dirty in smaps_rollup")


def copied_by_readers(rows, workers: int) -> float:
    """MiB a forked worker's private memory grows by while it reads every row once (mean over the workers)."""
    grown = []
    for _ in range(workers):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: read each row as CsvDataset.load does, then report
            os.close(read)
            before = private_dirty_kib(os.getpid())
            for index in range(len(rows)):
                image, caption = rows[index]
            os.write(write, str(private_dirty_kib(os.getpid()) - before).encode())
            os._exit(0)
        os.close(write)
        grown.append(int(os.read(read, 64)) / 1024)
        os.close(read)
        os.waitpid(pid, 0)
    return sum(grown) / len(grown)


def measure(name: str, build, workers: int) -> dict:
    tracemalloc.start()
    rows = build()
    memory, peak = (size / 2**20 for size in tracemalloc.get_traced_memory())
    tracemalloc.stop()
    start = time.perf_counter()
    payload = pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
    dumped = time.perf_counter() - start
    start = time.perf_counter()
    pickle.loads(payload)
    loaded = time.perf_counter() - start
    result = {"rows as": name, "in-process MiB": round(memory, 1), "peak while reading MiB": round(peak, 1),
              "pickled MiB": round(len(payload) / 2**20, 1),
              "pickle s": round(dumped, 3), "unpickle s": round(loaded, 3),
              "copied per forked reader MiB": round(copied_by_readers(rows, workers), 1)}
    print(json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--machine", default=f"{platform.machine()}, {os.cpu_count()} CPUs",
                        help="how the machine was, for the record (timings are only as quiet as the machine)")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON (the README's table)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "table.csv"
        write_table(path, args.rows)
        print(f"{args.rows:,} rows, {path.stat().st_size / 2**20:.1f} MiB of CSV; pid {os.getpid()}, {args.machine}")
        results = [measure("list of str tuples", lambda: read_caption_table(path), args.workers),
                   measure("PackedRows", lambda: PackedRows(CaptionTable(path)), args.workers)]
    if args.out:
        command = f"python benchmarks/csv_rows.py --rows {args.rows} --workers {args.workers}"
        args.out.write_text(json.dumps({"command": command, "rows": args.rows, "machine": args.machine,
                                        "torch": torch.__version__, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
