"""Media in and out of the engine: conditioning images from uploads and files
(``image_input``, ``condition_image``), result pixels as PNG images (``images``) and H.264 MP4
videos (``video``). The package's ``__init__`` imports nothing, so the pure
``condition_image`` stays free of torch and PIL.
"""
