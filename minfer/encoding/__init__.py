"""What pipelines ask of a text encoder: their tokenization and mask rules (presets.py), an
exact cache of encoder outputs (cache.py) and the hand-off of states to torch (tensors.py)."""
