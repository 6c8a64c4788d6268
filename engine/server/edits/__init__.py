"""POST /v1/images/edits: ``routes`` (the route), ``form`` (the multipart form read into the
generation fields and the images; whether the model edits and repaints) and ``openapi`` (the
form's schema and the answers).
"""
