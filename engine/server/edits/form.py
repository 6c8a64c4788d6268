"""The edit form (multipart) read into the generation fields and the images, and what the
served model makes of an edit: how many images it takes (``edit_images``) and whether it
repaints from its source (``repaints``: takes ``mask`` and ``strength``).

Images are checked and decoded by ``fields.uploads``; the text fields are typed as the JSON
body would carry them (``fields.extensions.form_value``), so the generation parser reads them
alike. Called by the edits route; ``app`` reads ``edit_images`` and ``repaints`` to choose
the OpenAPI document.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fastapi import Request

from ditserve.engine.request import ConditionImage
from ditserve.engine.server.errors import invalid, shown
from ditserve.engine.server.fields.body import Integer, Number, typed_fields
from ditserve.engine.server.fields.extensions import form_value
from ditserve.engine.server.fields.forms import fold_nested, once
from ditserve.engine.server.fields.uploads import is_file, read_image, read_mask, read_multipart
from ditserve.engine.server.generation.request import ImageGenerationRequest
from ditserve.engine.server.limits import RequestLimits
from ditserve.engine.server.state import ServerState

IMAGE_FIELDS = ("image", "image[]")
# OpenAI's edit-only fields that mean nothing to a DiT: accepted (with OpenAI's values) and
# ignored.
IGNORED_EDIT_FIELDS = {"input_fidelity": ("high", "low")}
# The form's number and flag fields: the generation body's own (``max_sequence_length``
# included), and the edit's ``strength``.
_INTEGERS = typed_fields(ImageGenerationRequest, Integer)
_NUMBERS = (*typed_fields(ImageGenerationRequest, Number), "strength")
_BOOLEANS = ("stream",)


def auto_size(image: ConditionImage, limits: RequestLimits) -> str:
    """The source's aspect ratio at the default size's area, on the pixel grid. A source
    too narrow for the grid (a 1x300 strip) gets the narrowest side the grid allows and the
    other side at the same area: the area holds, not the extreme ratio."""
    area = limits.default_size[0] * limits.default_size[1]
    aspect = image.width / image.height
    m = limits.pixel_multiple
    width = int(math.sqrt(area * aspect)) // m * m
    height = int(math.sqrt(area / aspect)) // m * m
    if width < m:
        width, height = m, area // m // m * m
    elif height < m:
        width, height = area // m // m * m, m
    width = max(m, min(limits.max_side, width))
    height = max(m, min(limits.max_side, height))
    return f"{width}x{height}"


@dataclasses.dataclass(frozen=True)
class Edit:
    """What an edit form carries besides the generation fields."""

    images: list[ConditionImage]
    mask: ConditionImage | None
    strength: float | None


async def read_edit(request: Request, state: ServerState) -> tuple[dict[str, Any], Edit]:
    """The form's text fields typed as the JSON body's (``fields.extensions.form_value``,
    the SDK's nested ``extra_body`` folded back: ``fields.forms``) and its images; a 400
    for a mask or strength on a model that does not repaint, or a field given twice."""
    upload = state.upload_limits()
    form = await read_multipart(request, upload)
    try:
        for name in ("mask", "strength"):
            if name in form and not repaints(state):
                raise invalid(name, f"{name}: masked edits (inpainting) and strength are not "
                                    f"supported by {state.model_name!r}; it edits the whole "
                                    f"image as the prompt says: send the image without {name}",
                              code="unsupported_value")
        mask_file = once(form, "mask")
        mask = None if mask_file is None else await read_mask(mask_file, limits=upload)
        given = [name for name in IMAGE_FIELDS if form.getlist(name)]
        if len(given) > 1:  # their order across the two names is lost: picture 1 is ambiguous
            raise invalid("image", "image: send the images as 'image' or as 'image[]', not "
                                   "both (the order of 'picture 1, 2, ...' would be lost)")
        files = [v for name in IMAGE_FIELDS for v in form.getlist(name)]
        if not files:
            raise invalid("image", "image: is required (one or more image files)",
                          code="missing_field")
        images = [await read_image(f, field="image", limits=upload) for f in files]
        plain, fields = fold_nested(form.multi_items())  # the SDK's step_cache[policy], ...
        for name in dict.fromkeys(name for name, _ in plain):
            if name in IMAGE_FIELDS or name == "mask":
                continue
            value = once(form, name)
            if name in IGNORED_EDIT_FIELDS:
                check_ignored(name, value)
                continue
            if is_file(value):
                raise invalid(name, f"{name}: must be a text field, not a file")
            fields[name] = form_value(name, str(value), integers=_INTEGERS,
                                      numbers=_NUMBERS, booleans=_BOOLEANS)
    finally:
        await form.close()
    strength = fields.pop("strength", None)
    return fields, Edit(images, mask, strength)


def check_ignored(name: str, value: Any) -> None:
    """An ignored edit field must still hold one of OpenAI's values (a typo is a 400)."""
    allowed = IGNORED_EDIT_FIELDS[name]
    if is_file(value) or str(value) not in allowed:
        raise invalid(name, f"{name}: must be one of {', '.join(map(repr, allowed))}, "
                            f"got {shown(value if not is_file(value) else 'a file')}")


def edit_images(state: ServerState) -> int:
    """The most images the replica's model edits from (0: it does not edit; /v1/images/edits
    is then left out of the document, as the route answers 400)."""
    if state.output != "image":
        return 0
    return int(state.model_limits().condition_images[1])


def repaints(state: ServerState) -> bool:
    """Whether the model denoises from its source image (takes an edit's mask and strength)."""
    return state.output == "image" and state.model_limits().image_strength is not None
