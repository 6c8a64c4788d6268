"""`ditserve generate`: one request on a local model, written to an image or an MP4.

Every value the flags leave out comes from the model and its diffusers pipeline
(``server.model_defaults``): a default ``ditserve generate`` runs what a default diffusers
call runs (guidance, true CFG, text length, a video model's frame count). ``--out`` must fit
what the model makes; a wrong extension is refused before the model loads.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ditserve.engine.config.adapters import parse_lora_arg
from ditserve.engine.config.flags import add_engine_options, engine_config_from_args
from ditserve.engine.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from ditserve.engine.request import SamplingParams
    from ditserve.engine.server.model_defaults import ModelDefaults

def _save_images(images: list, out: Path) -> list[Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    if len(images) == 1:
        images[0].save(out)
        return [out]
    paths = []
    for i, image in enumerate(images):
        path = out.with_name(f"{out.stem}-{i}{out.suffix or '.png'}")
        image.save(path)
        paths.append(path)
    return paths


def _save_videos(pixels: object, out: Path, fps: int, audio: object = None,
                 rate: int = 0) -> list[Path]:
    """One MP4 per video; with ``audio`` ((n, channels, samples) at ``rate``), each with its
    own sound track."""
    from ditserve.engine.media.video import write_mp4

    videos = list(pixels)  # type: ignore[call-overload]
    tracks = [None] * len(videos) if audio is None else [
        (track, rate) for track in audio]  # type: ignore[attr-defined]
    if len(videos) == 1:
        return [write_mp4(videos[0], out, fps=fps, audio=tracks[0])]
    return [write_mp4(v, out.with_name(f"{out.stem}-{i}{out.suffix or '.mp4'}"), fps=fps,
                      audio=track)
            for i, (v, track) in enumerate(zip(videos, tracks, strict=True))]


# A request field (``InvalidRequestError.field``, the HTTP API's names) -> its flag here.
FLAG_OF_FIELD = {
    "prompt": "--prompt", "negative_prompt": "--negative-prompt", "height": "--height",
    "width": "--width", "size": "--height/--width", "num_inference_steps": "--steps",
    "seed": "--seed", "guidance_scale": "--guidance-scale", "true_cfg_scale": "--true-cfg-scale",
    "max_sequence_length": "--max-sequence-length", "n": "--num-images",
    "num_images": "--num-images", "num_frames": "--num-frames", "image": "--image",
    "last_frame": "--last-image", "references": "--reference", "mask": "--mask",
    "strength": "--strength", "audio": "--audio", "loras": "--lora",
}
VIDEO_SUFFIX = ".mp4"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def output_path(out: Path | None, *, video: bool, still_images: bool = False) -> Path:
    """Where ``generate`` writes: ``--out`` if its extension fits what the model makes (an
    MP4 for a video model, an image format for an image model or for a video model that makes
    still images, ``still_images``: Cosmos3), else an error that says so."""
    if out is None:
        return Path("out.mp4" if video else "out.png")
    suffix = out.suffix.lower()
    if video and still_images and suffix in IMAGE_SUFFIXES:
        return out
    if video and suffix != VIDEO_SUFFIX:
        raise ConfigError(f"--out {out}: this is a video model, which writes an H.264 MP4; "
                          f"give a {VIDEO_SUFFIX} path (e.g. {out.with_suffix(VIDEO_SUFFIX)})")
    if not video and suffix not in IMAGE_SUFFIXES:
        raise ConfigError(f"--out {out}: this is an image model; give a path ending in one of "
                          f"{', '.join(IMAGE_SUFFIXES)} (e.g. {out.with_suffix('.png')})")
    return out


def still_image_frames(args: argparse.Namespace, out: Path) -> int | None:
    """A video model's image ``--out`` (``output_path`` let it through: the model makes still
    images) asks for its one frame: 1, or an error for --num-frames > 1 or --audio, which an
    image cannot hold. None for any other ``--out``: the flags stand."""
    if out.suffix.lower() not in IMAGE_SUFFIXES:
        return None
    if args.num_frames not in (None, 1):
        raise ConfigError(f"--out {out}: an image holds one frame; give --num-frames 1 or a "
                          f"{VIDEO_SUFFIX} path for {args.num_frames} frames")
    if args.audio:
        raise ConfigError(f"--out {out}: an image has no sound track; give a {VIDEO_SUFFIX} "
                          "path for --audio")
    return 1


def check_writable(out: Path) -> None:
    """Refuse an ``--out`` that cannot be written before minutes of generating: a directory,
    or a path whose folder is a file or not writable."""
    import os

    if out.is_dir():
        raise ConfigError(f"--out {out}: is a directory; give a file path such as "
                          f"{out / ('out' + (out.suffix or '.png'))}")
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"--out {out}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: the folder {folder} is not writable here")


def check_fps(args: argparse.Namespace, out: Path, *, native_fps: int, image: bool) -> None:
    """``--fps`` before the model loads: only for an MP4, within the writer's range, and left
    at the model's rate with ``--audio`` (the sound track is made for it; as the HTTP API)."""
    if args.fps is None:
        return
    if image:
        raise ConfigError(f"--fps {args.fps}: {out} is an image, which has no frame rate; "
                          "give a .mp4 --out of a video model, or leave --fps out")
    from ditserve.engine.media.video import MAX_ENCODER_FPS

    if not 1 <= args.fps <= MAX_ENCODER_FPS:
        raise ConfigError(f"--fps {args.fps}: must be in [1, {MAX_ENCODER_FPS}]")
    if args.audio and args.fps != native_fps:
        raise ConfigError(f"--fps {args.fps}: a video with its sound track (--audio) plays at "
                          f"the model's {native_fps} fps, which the sound is made for; leave "
                          "--fps out")


def generation_params(args: argparse.Namespace, defaults: ModelDefaults) -> SamplingParams:
    """The request ``generate`` runs: the flags given, the model pipeline's defaults for the
    rest (``server.model_defaults``: a default diffusers call's guidance, CFG, frames)."""
    from ditserve.engine.request import SamplingParams

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    return SamplingParams(
        prompt=args.prompt, negative_prompt=args.negative_prompt,
        height=given(args.height, defaults.height), width=given(args.width, defaults.width),
        num_inference_steps=given(args.steps, defaults.steps),
        guidance_scale=given(args.guidance_scale, defaults.guidance),
        true_cfg_scale=given(args.true_cfg_scale, defaults.true_cfg), seed=args.seed,
        num_images=args.num_images, num_frames=given(args.num_frames, defaults.frames),
        max_sequence_length=args.max_sequence_length, audio=args.audio,
    )


def _input_mask(path: Path | None) -> Any:
    """The --mask file, decoded to black and white as the server's ``mask`` is."""
    from ditserve.engine.media.image_input import decode_mask

    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"--mask {str(path)!r}: {e.strerror or e}") from e
    return decode_mask(data, field=f"--mask {path}")


def _input_images(paths: list[Path] | None, last: Path | None = None) -> tuple[Any, ...]:
    """--image files then the --last-image file, checked and decoded as the server's uploads
    are."""
    from ditserve.engine.media.image_input import decode_image

    images = []
    for flag, path in [*(("--image", p) for p in paths or ()),
                       *((("--last-image", last),) if last is not None else ())]:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"{flag} {str(path)!r}: {e.strerror or e}") from e
        images.append(decode_image(data, field=f"{flag} {path}"))
    return tuple(images)


def _references(paths: list[Path] | None) -> tuple[Any, ...]:
    """--reference files, in order, decoded as the server decodes ``references``."""
    from ditserve.engine.media.reference_input import decode_reference

    out = []
    for path in paths or ():
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"--reference {str(path)!r}: {e.strerror or e}") from e
        out.append(decode_reference(data, field=f"--reference {path}"))
    return tuple(out)


def cmd_generate(args: argparse.Namespace) -> int:
    from ditserve.engine.loop.engine import DiffusionEngine, WarmUp
    from ditserve.engine.server.model_defaults import model_defaults

    loras = [parse_lora_arg(text) for text in args.lora or ()]
    for text, (_, path, _) in zip(args.lora or (), loras, strict=True):
        if not Path(path).exists():  # refused before minutes of loading
            raise ConfigError(f"--lora {text!r}: adapter file {path!r} does not exist")
    if loras:  # the request's adapters are served as --lora-modules
        args.lora_modules = [*(args.lora_modules or ()), *(f"{n}={p}" for n, p, _ in loras)]
    config = engine_config_from_args(args)
    defaults = model_defaults(config.model)
    video = defaults.output == "video"
    # refused before minutes of loading
    out = output_path(args.out, video=video, still_images=defaults.still_images)
    check_writable(out)
    still_frames = still_image_frames(args, out) if video else None
    check_fps(args, out, native_fps=defaults.fps,
              image=not video or still_frames is not None)
    if args.image and defaults.still_images and 1 in (still_frames, args.num_frames):
        # Refused before loading by the rule the engine applies once loaded
        # (``capabilities.model_limits_of``: a still image is made from the text alone).
        raise ConfigError(f"--image: a one-frame request ({out}) does not use the input image "
                          f"(it conditions a video's first frame); give a {VIDEO_SUFFIX} --out "
                          "of more frames, or leave --image out")
    # --image files are decoded (and a bad one refused) before the model loads.
    params = replace(generation_params(args, defaults),
                     images=_input_images(args.image, args.last_image),
                     last_frame=args.last_image is not None,
                     mask=_input_mask(args.mask), strength=args.strength,
                     references=_references(args.reference))
    if still_frames is not None:  # a still image's one frame (Cosmos3's text-to-image)
        params = replace(params, num_frames=still_frames)
    fps = defaults.fps if args.fps is None else args.fps
    # With --compile: compile at the requested size before the request runs.
    engine = DiffusionEngine(config, warmup=WarmUp(compile_size=(params.height, params.width)))
    engine.start()
    try:
        if loras and engine.adapters is not None:
            params = replace(params, loras=engine.adapters.resolve(
                [(name, scale) for name, _, scale in loras]))
        started = time.perf_counter()
        try:
            handle = engine.add_request(
                params, on_event=lambda e: e.kind == "step" and print(
                    f"\rstep {e.step}/{e.total_steps}", end="", file=sys.stderr, flush=True)
            )
        except InvalidRequestError as e:  # named by the flag typed, not the API's field
            raise ConfigError(f"{FLAG_OF_FIELD.get(e.field, e.field)}: {e.message}") from e
        result = handle.result()
        print(file=sys.stderr)
        if result.is_video and out.suffix.lower() == VIDEO_SUFFIX:
            paths = _save_videos(result.pixels, out, fps, result.audio, result.audio_rate)
        else:
            paths = _save_images(result.images, out)
        print(f"saved {', '.join(map(str, paths))} (seed {result.seed}, "
              f"{params.num_inference_steps} steps, {time.perf_counter() - started:.2f}s)")
        stats = engine.stats()
        if stats.step_cache_block_runs:
            print(f"step cache: skipped {stats.step_cache_skipped_blocks} of "
                  f"{stats.step_cache_block_runs} block computations "
                  f"({stats.step_cache_skipped_fraction:.0%}), "
                  f"{stats.step_cache_skipped_bytes / 2**30:.2f} GiB of streamed weights "
                  f"not copied ({stats.step_cache_skipped_bytes} bytes)")
    finally:
        engine.shutdown()
    return 0


def add_generate_parser(subcommands: Any) -> None:
    gen = subcommands.add_parser("generate",
                                 help="generate one image (or video) with a local model")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt", default=None,
                     help="what CFG steers away from (\"\" counts: CFG against the empty "
                          "prompt, as diffusers)")
    gen.add_argument("--out", type=Path, default=None,
                     help="output path: an image (.png, .jpg, .webp; default out.png) for image "
                          "models, an H.264 .mp4 for video models (default out.mp4); a video "
                          "model that makes still images (Cosmos3) writes its one frame to an "
                          "image path")
    gen.add_argument("--height", type=int, default=None,
                     help="pixels (default: the model's usual size; 64 for a tiny model)")
    gen.add_argument("--width", type=int, default=None, help="pixels (default as --height)")
    gen.add_argument("--steps", type=int, default=None,
                     help="num_inference_steps (default: the pipeline's, e.g. 28 Flux-dev, 50 "
                          "Qwen-Image and Wan; 4 for a tiny model)")
    gen.add_argument("--seed", type=int, default=None, help="random if omitted (printed)")
    gen.add_argument("--guidance-scale", type=float, default=None,
                     help="default: the pipeline's (Flux 3.5 distilled guidance; Wan 5.0 CFG)")
    gen.add_argument("--true-cfg-scale", type=float, default=None,
                     help="CFG against --negative-prompt (even an empty one) when > 1; default: "
                          "the pipeline's (Flux 1.0: off; Qwen-Image 4.0)")
    gen.add_argument("--max-sequence-length", type=int, default=None,
                     help="text tokens per prompt (default: the pipeline's own, 512)")
    gen.add_argument("--num-images", type=int, default=1)
    gen.add_argument("--num-frames", type=int, default=None,
                     help="video models: frames (default: the model's usual count, 81 for "
                          "Wan; 4k+1)")
    gen.add_argument("--lora", action="append", default=None, metavar="NAME=PATH[:SCALE]",
                     help="apply a LoRA adapter file at SCALE (default 1); repeat to stack")
    gen.add_argument("--image", type=Path, action="append", default=None, metavar="PATH",
                     help="an input image (PNG, JPEG, WebP): the source of an edit model "
                          "(FLUX.1 Kontext, Qwen-Image-Edit) or an image-to-video model's "
                          "first frame; repeat it where the model takes several "
                          "(Qwen-Image-Edit Plus: up to 3); for Z-Image the source of "
                          "image-to-image")
    gen.add_argument("--last-image", type=Path, default=None, metavar="PATH",
                     help="the video's last frame (MiniMax-H3 keyframes): with --image, a "
                          "video from that first frame to this one; alone, a video ending on "
                          "it")
    gen.add_argument("--reference", type=Path, action="append", default=None, metavar="PATH",
                     help="a reference of an omni-reference replica (MiniMax-H3 ref2va: `model "
                          "ref2va`): an image (PNG, JPEG, WebP; up to 9), a video file "
                          "(MP4, WebM, MOV; up to 3, with its soundtrack) or a WAV soundtrack "
                          "at the audio VAE's rate (up to 3, with an image or a video); "
                          "repeat it, in the order the model reads them")
    gen.add_argument("--mask", type=Path, default=None, metavar="PATH",
                     help="inpainting with --image (Z-Image): the region to repaint, white "
                          "(or, in a PNG with transparency, transparent as OpenAI's edits)")
    gen.add_argument("--strength", type=float, default=None,
                     help="with --image on Z-Image: 1 starts from noise, lower keeps more of "
                          "the source and runs fewer steps (default 0.6; with --mask 1.0)")
    gen.add_argument("--fps", type=int, default=None,
                     help="video models: MP4 frame rate (default: the model's, 16 for Wan)")
    gen.add_argument("--audio", action="store_true",
                     help="video models that generate sound (Cosmos3 with a sound tokenizer): "
                          "generate the sound track too, muxed into the MP4 (AAC)")
    add_engine_options(gen, with_config_file=False)
    gen.set_defaults(func=cmd_generate)
