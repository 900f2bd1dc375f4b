"""The training loop and what it asks: the trainer, its state builder, evaluation, reporting, the stop guard."""
