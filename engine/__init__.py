"""Step-wise diffusion engine: continuous batching, layerwise offload, HTTP API."""
