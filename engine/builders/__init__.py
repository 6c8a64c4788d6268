"""Random-weight diffusers pipelines, one builder module per family.

Each module (``flux``, ``qwen_image``, ``wan``) builds its family's pipeline around a DiT
of the size asked for (the shapes are the family record's ``dit_sizes``), with deliberately
tiny text encoders, tokenizers from an in-code vocabulary and a tiny VAE of the family's
latent layout; nothing is downloaded. Each exposes ``build_pipeline(variant, size, *,
dtype, device, seed)`` and ``build_tiny(variant, seed)``; the family record names the module
(``Family.builders``) and ``engine.model_builders`` dispatches to it.
"""
