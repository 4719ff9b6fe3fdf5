"""SAM 3 image (detector) path: our own PyTorch implementation, checkpoint layout and tokenizer."""
