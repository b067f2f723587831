"""Issue #61's report specs, written from stage 1's lr rule before any result of stage 2 is read: the tests the
pre-registration (docs/results/preregistration-lorentz.md) names, as the report's spec files.

    python scripts/issue61.py ...                        # stage 1 trained and landed, pooled: lorentz-lr-9600
    python scripts/lorentz_specs.py                      # the specs of stage 2 and of the stability tables

This file was committed before stage 1 ended, so what each spec holds was fixed before any lr was chosen; running it
only puts in the lrs the rule picks. A spec that exists is never rewritten with other content (a pre-registered test
is written once): the script refuses and names it.

- `lorentz-19200-equivalence.json`, the primary endpoint: test in-domain mean recall at 19,200 steps, `lorentz` − the
  sphere (`tau-range-full-scenes-19200`'s `sphere-default-t`), Welch's t, then TOST at ±2.0 points.
- `lorentz-19200-tests.json`, the secondaries under one Holm adjustment: `lorentz-product` − Multi, the entailment
  loss in each family, on the same endpoint; out-of-domain mean recall and held-out-composition top-1 for these three
  and for `lorentz` − the sphere (whose in-domain test is the primary: "—" here, not one of the family's 11 tests).
- `lorentz-lr-9600-stability.json`, `lorentz-19200-stability.json` (beside the sphere's and Multi's fp32 runs) and
  `lorentz-precision-stability.json` (bf16 and fp16, seed 0: each run's folder `/work/exp/lorentz-precision/P-FAMILY`
  landed as `lorentz-precision-P-FAMILY`, e.g. copied to that name, then `topoclip report land`).
"""
from __future__ import annotations

import json
import sys
from collections import Counter

from topoclip.core.door import is_regular, read_text
from topoclip.experiments.results.files import RESULTS, load_result
from topoclip.experiments.results.tables import lr_choice

STAGE_1, STAGE_2, BASELINES = "lorentz-lr-9600", "lorentz-19200", "tau-range-full-scenes-19200"
SPHERE, MULTI = [BASELINES, "sphere-default-t"], [BASELINES, "multi-default-t"]
IN_DOMAIN, OUT_OF_DOMAIN = "headline:scenes-test/mean_recall", "headline:scenes-test-ood/mean_recall"
HELD_OUT = "headline:composition-held-out/distance/top1"
MARGIN = 2.0  # points of mean recall: the full scenes' margin (preregistration-hard-task.md)
SEEDS = 5
STAGE_1_SEEDS, STAGE_1_CELLS = 3, [f"{family}_lr-{lr}" for family in ("lorentz", "lorentz-product")
                                   for lr in ("5e-4", "1e-3", "2e-3")]  # the pre-registered grid (its --cells)


def specs(lorentz: str, product: str) -> dict[str, dict]:
    """{file name: spec} for the chosen cells `lorentz` (lorentz_lr-X) and `product` (lorentz-product_lr-Y)."""
    entail, product_entail = (cell.replace("_lr-", "-entail_lr-") for cell in (lorentz, product))
    stage_1 = load_result(STAGE_1)
    return {
        f"{STAGE_2}-equivalence.json": {
            "about": f"The primary endpoint, pre-registered (preregistration-lorentz.md): test in-domain mean recall "
                     f"at 19,200 steps, MERU's hyperboloid `{lorentz}` (a) − the sphere at its lr (b), five seeds each.",
            "margin": MARGIN, "seeds": SEEDS,
            "rows": [{"label": "`lorentz` − sphere, test in-domain mean recall, 19,200 steps", "metric": IN_DOMAIN,
                      "a": [[STAGE_2, lorentz]], "b": [SPHERE]}]},
        f"{STAGE_2}-tests.json": {
            "about": "The secondary endpoints, pre-registered: Welch's t, Holm's adjustment over the table's tests; "
                     "`lorentz` − sphere's in-domain recall is the primary endpoint's (its own table).",
            "source": STAGE_2,
            "metrics": [{"metric": IN_DOMAIN, "label": "test in-domain mean recall"},
                        {"metric": OUT_OF_DOMAIN, "label": "out-of-domain mean recall"},
                        {"metric": HELD_OUT, "label": "held-out compositions top-1"}],
            "rows": [{"label": "`lorentz` − sphere", "a": lorentz, "b": SPHERE, "metrics": [OUT_OF_DOMAIN, HELD_OUT]},
                     {"label": "`lorentz-product` − Multi", "a": product, "b": MULTI},
                     {"label": "entailment loss: `lorentz-entail` − `lorentz`", "a": entail, "b": lorentz},
                     {"label": "entailment loss: `lorentz-product-entail` − `lorentz-product`", "a": product_entail,
                      "b": product}]},
        f"{STAGE_1}-stability.json": {
            "about": "Stage 1 (the lr grid, 9,600 steps, three seeds, fp32): every run's skipped steps, τ and c.",
            "rows": [{"label": f"`{cell}`", "source": STAGE_1, "cell": cell}
                     for cell in dict.fromkeys(run["cell"] for run in stage_1["runs"] + stage_1.get("stopped", []))]},
        f"{STAGE_2}-stability.json": {
            "about": "Stage 2 (19,200 steps, five seeds, fp32) beside the sphere's and Multi's runs of the same length.",
            "rows": [{"label": f"`{cell}`", "source": STAGE_2, "cell": cell}
                     for cell in (lorentz, entail, product, product_entail)]
                    + [{"label": f"{name} (`{cell}`)", "source": source, "cell": cell}
                       for name, (source, cell) in (("the sphere", SPHERE), ("Multi", MULTI))]},
        "lorentz-precision-stability.json": {
            "about": "The precision arm, on one GPU: one run (seed 0, 9,600 steps) of each family at its lr in bf16, "
                     "in fp16 and in fp32 (TF32 off), beside stage 1's fp32 runs of the same cell on the CPU.",
            "rows": [{"label": f"`{cell}`, {precision}", "source": source, "cell": cell}
                     for cell in (lorentz, product)
                     for precision, source in (("fp32 (stage 1, CPU)", STAGE_1),
                                               *((p + " (GPU)", f"lorentz-precision-{p}-{cell.split('_lr-')[0]}")
                                                 for p in ("fp32", "bf16", "fp16")))]},
    }


def main() -> int:
    stage_1 = load_result(STAGE_1)
    done = Counter(run["cell"] for run in stage_1["runs"] + stage_1.get("stopped", []))
    short = [cell for cell in STAGE_1_CELLS if done[cell] < STAGE_1_SEEDS]
    if short:  # the rule reads whole cells: a stage 1 in parts may be landed only in part
        print(f"lorentz_specs: stage 1 is not whole yet: {', '.join(f'{c} ({done[c]} of {STAGE_1_SEEDS})' for c in short)}",
              file=sys.stderr)
        return 1
    choice = lr_choice(stage_1)
    texts = {RESULTS / name: json.dumps(spec, indent=1, ensure_ascii=False) + "\n"
             for name, spec in specs(choice["lorentz"], choice["lorentz-product"]).items()}
    changed = [path.name for path, text in texts.items()
               if path.exists() and not (is_regular(path, RESULTS) and read_text(path, "spec", RESULTS) == text)]
    if changed:  # checked before any is written: all or nothing
        print(f"lorentz_specs: {', '.join(changed)} exist with other content: a pre-registered spec is written once",
              file=sys.stderr)
        return 1
    for path, text in texts.items():
        path.write_text(text, encoding="utf-8")
    print(f"the rule's cells: {choice['lorentz']}, {choice['lorentz-product']}; wrote "
          f"{', '.join(path.name for path in texts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
