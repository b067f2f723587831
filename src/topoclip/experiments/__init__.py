"""Experiments that train many runs: ablation grids (`grid`, `runner`, `report`), `compare`, and the
statistics over seeds their reports use. Analyses of one trained model live in `topoclip.analysis`."""
