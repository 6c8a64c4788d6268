"""What the endpoints share in reading a request, whichever route parses it: ``body`` (JSON
decoding, the strict number types, pydantic's first problem and the engine's verdict as a
field-precise 400), ``extensions`` (ditserve's extension fields of every generation request
parsed in one place, and a form's text field typed as JSON), ``adapters`` (``model`` and
``loras`` resolved against the adapter catalog), ``step_cache`` (the ``step_cache`` field and
its schemas), ``forms`` (the OpenAI SDK's bracketed multipart fields folded back into
objects) and ``uploads`` (multipart bodies and uploaded images). No endpoint's own rules live
here.
"""
