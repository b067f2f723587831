"""The paper's analyses as functions and commands, one file per analysis.

Each analysis takes a trained model (a run folder or a checkpoint, see :mod:`.inputs`) — or, for
`temperature` and `cost`, run folders or a preset — and writes ``<name>.png`` plot(s) plus
``<name>.json`` with the numbers behind them (see :mod:`.output`):

- temperature:  τ and t over training, the convergence step, several runs overlaid (Fig. 4);
- similarities: positive / negative similarity histograms in- and out-of-domain (Fig. 6);
- equilibrium:  alignment vs uniformity term of InfoNCE as τ varies, with shuffled captions;
- landscape:    loss on a random filter-normalised weight plane at τ = 1 and 100; gradient norms;
- gradcam:      Grad-CAM of the matching score (total and per class-token pair) on patches and tokens;
- experts:      zero-shot accuracy from random subsets of the m sub-spheres (Table 10);
- probe:        linear probe on the frozen class-token features;
- cost:         parameters, forward FLOPs (counted, and by the transformer FLOP formula), logit memory.

The package never imports the trainer (scripts/import_graph.py checks it); grids of many trained runs
(Tables 3/4/6) are `topoclip.experiments`.
"""

ANALYSES = ("temperature", "similarities", "equilibrium", "landscape", "gradcam", "experts", "probe", "cost")
