"""/v1/videos, OpenAI's Videos API over the video jobs (``server.jobs``): ``routes`` (create,
list, retrieve, delete, content and events), ``request`` (the create body, JSON or a form, to
a ``VideoSpec``), ``openapi`` (their schemas and answers) and ``byte_ranges`` (the content
route's Range requests).
"""
