"""topoclip's Lorentz functions against MERU's own (facebookresearch/meru, meru/lorentz.py), on random inputs.

    python scripts/meru_equality.py MERU_CHECKOUT [--out docs/results/meru-equality.json]

MERU is licensed CC BY-NC 4.0, so its code is not copied into this MIT project: point this script at a checkout
(git clone https://github.com/facebookresearch/meru). It imports MERU_CHECKOUT/meru/lorentz.py, which is code: run it
on a checkout you trust. tests/test_lorentz.py checks the file this writes (and, given TOPOCLIP_MERU=CHECKOUT, runs
the comparison itself).

Both sides run in float64 on the same inputs, for three curvatures. MERU adds eps = 1e-8 to its denominators and
clamps with it; those terms are passed as 1e-300 here (`eps=`), which leaves both computing the same closed forms,
so they agree to float64 rounding: each function is a chain of at most ~64 operations on these inputs, whose
condition numbers the script measures (`condition`, the largest over the inputs), so the difference is at most
64 · condition · 2⁻⁵³ · max|value| (`bound`). With MERU's own eps the aperture and the angle differ by its eps
terms alone: eps/(√c‖x‖) relative on the aperture's input, eps on the angle's denominator (`with_meru_eps`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from topoclip.core import geometry as G

CURVATURES = (0.1, 1.0, 3.0)
TINY_EPS = 1e-300
OPERATIONS = 64


def meru_module(checkout: Path):
    """MERU's meru/lorentz.py, imported from the checkout (code: a checkout the caller trusts)."""
    spec = importlib.util.spec_from_file_location("meru_lorentz", checkout / "meru" / "lorentz.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def commit(checkout: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tangent(count: int, low: float, high: float, c: float, generator: torch.Generator) -> torch.Tensor:
    """(count, 32) float64 tangent vectors in random directions with √c‖v‖ spread log-evenly over [low, high]."""
    v = torch.randn(count, 32, generator=generator, dtype=torch.float64)
    radii = torch.logspace(math.log10(low), math.log10(high), count, dtype=torch.float64)[:, None]
    return v / v.norm(dim=-1, keepdim=True) * radii / c**0.5


def inputs(c: float, seed: int):
    """Tangent vectors for the maps (from near the origin to past MERU's sinh clamp, √c‖v‖ 1e-3 … 15), and two sets of
    points at √c‖v‖ 0.3 … 4: outside the aperture's undefined ball (2K = 0.2) and inside the sinh clamp."""
    generator = torch.Generator().manual_seed(seed)
    return (tangent(24, 1e-3, 15.0, c, generator), G.exp_map0(tangent(24, 0.3, 4.0, c, generator), c),
            G.exp_map0(tangent(24, 0.3, 4.0, c, generator).flip(0), c))


def compare(meru, c: float, seed: int) -> dict:
    v, x, y = inputs(c, seed)
    ours = {"exp_map0": G.exp_map0(v, c), "log_map0": G.log_map0(x, c),
            "pairwise_dist": G.lorentz_distances(x[:, None], y[:, None], c)[..., 0],
            "half_aperture": G.half_aperture(x, c), "oxy_angle": G.exterior_angle(x, y, c)}
    theirs = {"exp_map0": meru.exp_map0(v, c, eps=TINY_EPS), "log_map0": meru.log_map0(x, c, eps=TINY_EPS),
              "pairwise_dist": meru.pairwise_dist(x, y, c, eps=TINY_EPS),
              "half_aperture": meru.half_aperture(x, c, eps=TINY_EPS), "oxy_angle": meru.oxy_angle(x, y, c, eps=TINY_EPS)}
    defaults = {"half_aperture": meru.half_aperture(x, c), "oxy_angle": meru.oxy_angle(x, y, c),
                "pairwise_dist": meru.pairwise_dist(x, y, c)}
    # Condition numbers of the closed forms on these inputs: the cancellation in −c⟨x, y⟩_L = c(t_x t_y − xᵀy), arcosh
    # near 1, and arccos / arcsin near ±1 (their arguments' distance from 1).
    t_x, t_y = G.lorentz_time(x, c), G.lorentz_time(y, c)
    cancellation = ((t_x[:, None] * t_y[None] + (x @ y.T).abs()) / (t_x[:, None] * t_y[None] - x @ y.T)).max()
    z = c * (t_x[:, None] * t_y[None] - x @ y.T)
    arcosh = (z / ((z.square() - 1).sqrt() * torch.acosh(z))).max()
    angle_cos = torch.cos(ours["oxy_angle"])
    aperture_sin = torch.sin(ours["half_aperture"])
    arc = (1 / (1 - torch.cat([angle_cos.abs(), aperture_sin]).square()).clamp_min(1e-300).sqrt()).max()
    condition = float(max(cancellation, arcosh, arc, 1.0) * cancellation)
    rows = {}
    for name in ours:
        scale = float(theirs[name].abs().max())
        rows[name] = {"max_abs_difference": float((ours[name] - theirs[name]).abs().max()), "max_abs_value": scale,
                      "bound": OPERATIONS * condition * 2.0**-53 * max(scale, 1.0)}
    for name, value in defaults.items():
        rows[name]["with_meru_eps"] = float((ours[name] - value).abs().max())
    return {"curvature": c, "condition": condition, "functions": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a clone of github.com/facebookresearch/meru")
    parser.add_argument("--out", type=Path, help="write the comparison here (JSON)")
    args = parser.parse_args(argv)
    meru = meru_module(args.checkout)
    results = {"about": "topoclip.core.geometry against MERU's meru/lorentz.py, float64, random inputs "
                        "(scripts/meru_equality.py)", "meru_commit": commit(args.checkout),
               "torch": torch.__version__.split("+")[0],
               "runs": [compare(meru, c, seed) for seed, c in enumerate(CURVATURES)]}
    worst = all(row["max_abs_difference"] <= row["bound"] for run in results["runs"] for row in run["functions"].values())
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if worst else 1


if __name__ == "__main__":
    sys.exit(main())
