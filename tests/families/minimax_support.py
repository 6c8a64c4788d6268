"""What MiniMax-H3's tests (t2va, fl2va, ref2va) share: the clip length, random keyframes and
references, and diffusers' modular pipeline set up as ditserve's environment allows."""

from __future__ import annotations

import io
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ditserve.engine.request import ConditionImage, SamplingParams

FRAMES = 124  # 5 s at 24 fps, 17 n + 5: the family's shortest clip
# A clip of a few hundred rows; MiniMax-H3 is guidance-distilled.
BASE = {"num_frames": FRAMES, "height": 32, "width": 64, "guidance_scale": 1.0}


def frame(width: int, height: int, seed: int) -> ConditionImage:
    """An image of random pixels (every pixel reaches the VAE and the vision tower)."""
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(seed))
    return ConditionImage(width, height, pixels.numpy().tobytes())


def diffusers_pipeline(model_dir: Path, dit: str, *, device: str = "cpu",
                       workflow: str | None = None) -> Any:
    """diffusers' modular pipeline on ``model_dir`` in float32 with ``dit`` (``transformer``
    or ``transformer_ref``) as its DiT, on ``device``."""
    import diffusers
    from transformers import AutoImageProcessor
    from transformers.processing_utils import ProcessorMixin

    from ditserve.engine.families.minimax_h3 import video_processor

    options = {} if workflow is None else {"workflow": workflow}
    pipe = diffusers.ModularPipeline.from_pretrained(str(model_dir), **options)
    parts = (dit, "text_encoder", "tokenizer", "vae", "audio_vae", "scheduler",
             "audio_scheduler")
    pipe.load_components(names=list(parts), dtype=torch.float32)
    for name in (dit, "text_encoder", "vae", "audio_vae"):
        getattr(pipe, name).to(device)
    pipe.set_progress_bar_config(disable=True)
    # The Qwen3-VL processor needs torchvision for its video half (not installed here); the
    # workflows call its image processor (transformers' own, from the model's processor
    # folder) and create_mm_token_type_ids (transformers' function, given the ids).
    config = pipe.text_encoder.config
    ids = types.SimpleNamespace(image_token_ids=[config.image_token_id],
                                video_token_ids=[config.video_token_id], audio_token_ids=[])
    # Its video processor is ditserve's torchvision-free one (equal to transformers' where
    # torchvision imports: tests/families/test_minimax_h3_video_processor.py).
    pipe.processor = types.SimpleNamespace(
        image_processor=AutoImageProcessor.from_pretrained(str(model_dir / "processor")),
        video_processor=video_processor.load(model_dir / "processor"),
        create_mm_token_type_ids=lambda x: ProcessorMixin.create_mm_token_type_ids(ids, x))
    return pipe


def reference(model_dir: Path, p: SamplingParams, device: str = "cpu"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' modular pipeline on the same directory: (1, F, 3, H, W), (1, 2, samples).
    A request with images runs diffusers' ``fl2va`` workflow (``image``: the first frame,
    ``last_image``: the last)."""
    from ditserve.engine.pipelines.conditioning import to_pil

    pipe = diffusers_pipeline(model_dir, "transformer", device=device)
    frames = [to_pil(image) for image in p.images]
    keyframes: dict[str, Any] = {}
    if frames:
        keyframes["last_image" if p.last_frame else "image"] = frames[-1]
        if len(frames) == 2:
            keyframes["image"] = frames[0]
    # diffusers counts its sigma grid's points: one more than the forwards (pipeline doc).
    out = pipe(prompt=p.prompt, num_frames=p.num_frames, height=p.height, width=p.width,
               num_inference_steps=p.num_inference_steps + 1,
               generator=torch.Generator().manual_seed(p.seed or 0), output_type="pt",
               output=["videos", "audio"], **keyframes)
    return out["videos"].cpu(), out["audio"].cpu()


# Keyframe requests (fl2va) beside a text-only one, at other steps; one request's two videos.
KEYFRAME_MIX: dict[int, list[tuple[str, SamplingParams]]] = {
    0: [("first", SamplingParams(prompt="a lighthouse at dawn", num_inference_steps=3, seed=31,
                                 images=(frame(64, 32, 5),), **BASE)),
        # The same keyframe size: one packed forward with "first", another anchor.
        ("last", SamplingParams(prompt="sea", num_inference_steps=2, seed=32,
                                images=(frame(64, 32, 6),), last_frame=True, **BASE)),
        ("text", SamplingParams(prompt="two cats", num_inference_steps=2, seed=33, **BASE))],
    1: [("both", SamplingParams(prompt="a storm", num_inference_steps=2, seed=34, num_images=2,
                                images=(frame(64, 32, 7), frame(40, 40, 8)), last_frame=True,
                                **BASE))],
}


def mp4(seconds: float, fps: int, width: int, height: int, seed: int, *,
        sound_rate: int | None = None) -> bytes:
    """An H.264 MP4 of smooth random motion (a drifting gradient plus noise), with an AAC
    mono soundtrack at ``sound_rate`` if given."""
    import av

    rng = np.random.default_rng(seed)
    count = round(seconds * fps)
    base = rng.integers(0, 256, size=(height, width, 3)).astype(np.int32)
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = None
        if sound_rate is not None:
            audio = container.add_stream("aac", rate=sound_rate, layout="mono")
        for index in range(count):
            pixels = ((base + 7 * index) % 256).astype(np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        container.mux(video.encode())
        if audio is not None:
            assert sound_rate is not None
            samples = int(seconds * sound_rate)
            wave = (np.sin(np.arange(samples) * 0.05) * 0.5).astype(np.float32)[None]
            step = 1024
            for start in range(0, samples, step):
                chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, start:start + step]),
                                                   format="fltp", layout="mono")
                chunk.sample_rate = sound_rate
                for packet in audio.encode(chunk):
                    container.mux(packet)
            container.mux(audio.encode())
    return out.getvalue()
