"""Training: the step (forward + backward of the contrastive loss), optimiser, trainer."""
