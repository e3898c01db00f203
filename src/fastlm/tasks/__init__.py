"""Synthetic and text datasets, with the training loops that study them."""
