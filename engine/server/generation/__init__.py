"""An image generation request as the two image routes share it (``images`` and ``edits``):
``request`` (its body and the mapping to SamplingParams), ``waiting`` (admission, then the
images or the event stream; timeouts and disconnects), ``events`` (the streams' event names),
``responses`` (OpenAI's images answer and stream payloads) and ``openapi`` (the body's schema,
from which the edit form derives, the answers and the events).
"""
