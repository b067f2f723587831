"""What a topology costs: the similarity and loss alone, and a whole CPU training step, one JSON file.

    python benchmarks/topology_cost.py --out docs/results/topology-cost.json    # a quiet machine, 2 threads

The paper set hyperbolic space aside partly because "its resource required for computing distance is high".
Measured here, on random inputs:

- **scoring**: similarity + symmetric InfoNCE, forward and backward, of a (B, m, n) batch against itself for every
  topology, B = 256 … 4096, at the default run's shapes: one vector of 128 (sphere, euclidean, lorentz) and 8 rows
  of 16 (the products). The median of `--repeats` after a warm-up, in milliseconds.
- **step**: benchmarks/train_step.py's whole training step (forward, backward, AdamW) of the CPU presets, the sphere
  and Multi, each beside its hyperbolic twin (cpu-sphere as lorentz, cpu-multi as lorentz-product, both with MERU's
  entailment loss at 0.2). Images per second: the median step of each run, the median over --rounds rounds of the
  four in turn.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from topoclip.core.door import read_json  # noqa: E402
from topoclip.core.geometry import TOPOLOGIES, similarity, to_space  # noqa: E402
from topoclip.core.losses import infonce_loss  # noqa: E402
from train_step import measure  # noqa: E402

SHAPES = {False: (1, 128), True: (8, 16)}  # (m, n) by Topology.product
STEPS = [("cpu-sphere", ()), ("cpu-sphere", ("model.topology=lorentz", "train.entailment_weight=0.2")),
         ("cpu-multi", ()), ("cpu-multi", ("model.topology=lorentz-product", "train.entailment_weight=0.2"))]


def scoring_ms(topology: str, batch: int, repeats: int) -> float:
    """Median milliseconds of similarity + InfoNCE forward and backward on a (batch, m, n) batch."""
    entry = TOPOLOGIES[topology]
    m, n = SHAPES[entry.product]
    keywords = {"curvature": torch.tensor(1.0, requires_grad=True)} if entry.curved else {}
    generator = torch.Generator().manual_seed(0)
    raw_u = torch.randn(batch, m, n, generator=generator, requires_grad=True)
    raw_v = torch.randn(batch, m, n, generator=generator, requires_grad=True)
    scale = torch.tensor(10.0)

    def once() -> None:
        u, v = to_space(topology, raw_u, **keywords), to_space(topology, raw_v, **keywords)
        s = similarity(topology, u, v, **keywords)
        infonce_loss(s, s.T, scale, None).backward()

    for _ in range(2):
        once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures here (JSON)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per preset and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the four presets in turn (the step's figure: "
                        "the median round, so a preset measured first or beside a noise burst is not singled out)")
    parser.add_argument("--steps-only", type=Path, help="re-measure the steps alone, keeping this file's scoring")
    parser.add_argument("--quiet-machine", choices=["yes", "no"], required=True,
                        help="whether nothing else ran beside it (recorded with the figures)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps_only:
        scoring = read_json(args.steps_only, "a topology_cost result")["scoring"]
    else:
        scoring = [{"topology": name, "batch": batch, "m": SHAPES[entry.product][0], "n": SHAPES[entry.product][1],
                    "milliseconds": round(scoring_ms(name, batch, args.repeats), 2)}
                   for name, entry in TOPOLOGIES.items() for batch in args.batches]
    rounds = [[measure(preset, 128, threads=args.threads, steps=args.steps, overrides=overrides)
               for preset, overrides in STEPS] for _ in range(args.rounds)]
    steps = []
    for runs in zip(*rounds):  # one preset's runs, a round each
        rates = [run["median_images_per_s"] for run in runs]
        steps.append({**runs[0], "rounds_images_per_s": rates, "median_images_per_s": statistics.median(rates)})
    result = {"benchmark": "topology_cost", "threads": torch.get_num_threads(), "torch": torch.__version__.split("+")[0],
              "quiet_machine": args.quiet_machine == "yes", "scoring": scoring, "steps": steps}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
