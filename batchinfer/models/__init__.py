"""Model configs and the pure-PyTorch reference forward."""
