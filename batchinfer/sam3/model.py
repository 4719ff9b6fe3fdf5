"""The SAM 3 image model: our PyTorch implementation of Meta's `Sam3Image` text-prompt path.

Module names mirror Meta's, so `state_dict()` keys are those of `sam3.pt` without the `detector.`
prefix. Data flow (Meta's `forward_grounding`): the backbone runs once per image, the text encoder
once per distinct prompt (cached on the model), and the rest once per (image, prompt) pair, batched.
Build on the meta device for real shapes without memory: `with torch.device("meta"): Sam3Model(cfg)`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from batchinfer.errors import InputError
from batchinfer.sam3.api import Instance, PairResult
from batchinfer.sam3.config import Sam3Config
from batchinfer.sam3.decoder import Decoder
from batchinfer.sam3.fusion import FusionEncoder, GeometryEncoder
from batchinfer.sam3.heads import DotProductScoring, SegmentationHead
from batchinfer.sam3.postprocess import preprocess_image, select_pairs
from batchinfer.sam3.text import TextEncoder
from batchinfer.sam3.tokenizer import ClipTokenizer
from batchinfer.sam3.vit import Neck, sine_position_2d

logger = logging.getLogger(__name__)

TEXT_CACHE_SIZE = 4096  # distinct prompts kept encoded on the device (a few KB each at real shapes)


class Backbone(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        self.vision_backbone = Neck(config)
        self.language_backbone = TextEncoder(config)


class Transformer(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        self.encoder = FusionEncoder(config)
        self.decoder = Decoder(config)


@dataclass(slots=True)
class GroundingOutput:
    """Raw outputs for N (image, prompt) pairs."""

    logits: Tensor  # [N, Q] query logits (before the presence factor)
    presence_logit: Tensor  # [N]
    boxes: Tensor  # [N, Q, 4] cxcywh in [0, 1]
    mask_logits: Tensor  # [N, Q, 4g, 4g]


class Sam3Model(nn.Module):
    def __init__(self, config: Sam3Config) -> None:
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        self.geometry_encoder = GeometryEncoder(config)
        self.transformer = Transformer(config)
        self.dot_prod_scoring = DotProductScoring(config)
        self.segmentation_head = SegmentationHead(config)
        self._tokenizer: ClipTokenizer | None = None
        self._text_cache: OrderedDict[str, tuple[Tensor, Tensor]] = OrderedDict()

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, config: Sam3Config | None = None, device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Sam3Model:  # fmt: skip
        """Load Meta's `sam3.pt` / SAM 3.1 detector keys or our safetensors; see `checkpoint.py`."""
        from batchinfer.sam3.checkpoint import load_sam3_state_dict

        state, config = load_sam3_state_dict(path, config)
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, assign=True)
        return model.to(device=device, dtype=dtype).eval()

    @property
    def tokenizer(self) -> ClipTokenizer:
        if self._tokenizer is None:
            self._tokenizer = ClipTokenizer()
        return self._tokenizer

    def _param(self) -> Tensor:
        return self.backbone.language_backbone.resizer.weight

    def encode_images(self, pixels: Tensor) -> list[Tensor]:
        """pixels [B, 3, S, S] in [-1, 1] -> neck maps [x4, x2, x1], each [B, d, *, *]."""
        p = self._param()
        return self.backbone.vision_backbone(pixels.to(device=p.device, dtype=p.dtype))

    def encode_prompts(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Distinct prompt strings -> (features [P, T, d], padding mask bool [P, T]); cached per string."""
        param = self._param()
        cached = next(iter(self._text_cache.values()), None)
        if cached is not None and (cached[0].device, cached[0].dtype) != (param.device, param.dtype):
            self._text_cache.clear()  # the model moved or changed precision since
        missing = list(dict.fromkeys(p for p in prompts if p not in self._text_cache))
        if missing:
            tokens = self.tokenizer(missing, self.config.text_context).to(param.device)
            feats, mask = self.backbone.language_backbone(tokens)
            for i, prompt in enumerate(missing):
                self._text_cache[prompt] = (feats[i], mask[i])
        for prompt in prompts:
            self._text_cache.move_to_end(prompt)
        feats = torch.stack([self._text_cache[p][0] for p in prompts])
        mask = torch.stack([self._text_cache[p][1] for p in prompts])
        while len(self._text_cache) > TEXT_CACHE_SIZE:
            self._text_cache.popitem(last=False)
        return feats, mask

    def ground(
        self, fpn: list[Tensor], image_ids: Tensor, text: Tensor, text_mask: Tensor
    ) -> GroundingOutput:
        """N pairs: image_ids int64 [N] index the neck maps `fpn`; text [N, T, d], text_mask [N, T]."""
        x1 = fpn[-1][image_ids]  # [N, d, g, g]
        n, d, g, _ = x1.shape
        # Both token-major and materialized, so that the image-sized adds of the geometry encoder, the
        # fusion encoder and the decoder (h + pos, memory + memory_pos, the first residual) read contiguous
        # operands; on the transposed views they read with a stride of g*g. Likely most of the strided adds
        # outside the backbone in the H200 profile: 7.9 ms of a 16-image batch's 240 ms (PERF_IMAGES.md).
        tokens = x1.flatten(2).transpose(1, 2).contiguous()  # [N, g*g, d]
        pos = sine_position_2d(d, g, g, x1.device).to(x1.dtype).flatten(1).T.expand(n, -1, -1).contiguous()
        geo = self.geometry_encoder(tokens, pos)  # [N, 1, d]
        prompt = torch.cat([text, geo], dim=1)
        prompt_mask = torch.cat([text_mask, torch.zeros(n, 1, dtype=torch.bool, device=x1.device)], dim=1)
        fused = self.transformer.encoder(tokens, pos, prompt, prompt_mask)
        queries, boxes, presence = self.transformer.decoder(fused, pos, (g, g), prompt, prompt_mask)
        logits = self.dot_prod_scoring(queries, prompt, prompt_mask)
        masks = self.segmentation_head([f[image_ids] for f in fpn[:-1]], fused, queries, prompt, prompt_mask)
        return GroundingOutput(logits=logits, presence_logit=presence, boxes=boxes, mask_logits=masks)

    @torch.inference_mode()
    def segment_pairs(
        self, images: Sequence[Tensor], prompts: Sequence[Sequence[str]], score_threshold: float,
        pairs_per_batch: int = 16,
    ) -> list[list[PairResult]]:  # fmt: skip
        """Per image, per prompt: the presence score and the instances above `score_threshold`.

        images: uint8 [H, W, 3] tensors of any size; prompts[i] are image i's prompt strings.
        `pairs_per_batch` bounds how many (image, prompt) pairs share one fusion/decoder/mask pass
        (activation memory grows with it: about 0.2 GB per pair at real shapes in bf16)."""
        if len(images) != len(prompts):
            raise InputError(f"segment: {len(images)} images but {len(prompts)} prompt lists")
        if not images:
            return []
        device = self._param().device  # resize on the model's device, not on the thread that feeds it
        pixels = torch.stack([preprocess_image(img.to(device), self.config.image_size) for img in images])
        fpn = self.encode_images(pixels)
        distinct = list(dict.fromkeys(p for plist in prompts for p in plist))
        pairs = [(i, p) for i, plist in enumerate(prompts) for p in plist]
        results: list[list[PairResult]] = [[] for _ in images]
        if not pairs:
            return results
        text, text_mask = self.encode_prompts(distinct)
        index = {p: j for j, p in enumerate(distinct)}
        for start in range(0, len(pairs), pairs_per_batch):
            chunk = pairs[start : start + pairs_per_batch]
            image_ids = torch.tensor([i for i, _ in chunk], device=device)
            text_ids = torch.tensor([index[p] for _, p in chunk], device=device)
            out = self.ground(fpn, image_ids, text[text_ids], text_mask[text_ids])
            sizes = [(images[i].shape[0], images[i].shape[1]) for i, _ in chunk]
            selected = select_pairs(
                out.logits, out.presence_logit, out.boxes, out.mask_logits, sizes, score_threshold
            )
            for (i, _), pair in zip(chunk, selected, strict=True):
                results[i].append(pair)
        return results

    def segment(
        self, images: Sequence[Tensor], prompts: Sequence[Sequence[str]], score_threshold: float
    ) -> list[list[list[Instance]]]:
        """The `ImageSegmenter` interface: per image, per prompt, instances best first."""
        return [
            [r.instances for r in per_image]
            for per_image in self.segment_pairs(images, prompts, score_threshold)
        ]
