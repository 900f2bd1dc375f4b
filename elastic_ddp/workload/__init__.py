"""What to train: built-in models and data, losses, user code by import path, the elastic sampler."""
