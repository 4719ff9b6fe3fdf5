"""The image path's job side: inputs, decoding, the `image` task, mask RLE, and a model-free engine.

The SAM 3 model itself lives in `batchinfer.sam3`; this package reaches it only through
`SegmenterEngine` (any object with SAM 3's `segment(images, prompts, score_threshold)`).
"""
