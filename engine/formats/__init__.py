"""Host weight formats for streamed DiT blocks: lossless packed bf16, rowwise FP8, GGUF blocks.

Leaf modules, no engine state: the offload storage, the runtime cache and the benchmarks call
them. One concept per module:

- ``packed_layout``: where every byte of a packed bf16 run lies (pure; shards, manifests);
- ``packed_encode``: the encoder (torch on a CPU or a CUDA device; at offload enable);
- ``packed_decode``: decoding into a caller-owned bf16 tensor (CPU; dispatches CUDA);
- ``packed_triton``: the Triton GPU decoder (imported only on CUDA);
- ``gguf_fused``: GGUF Q8_0 and Q4_K dequantization into a caller's tensor (CPU; dispatches
  CUDA);
- ``gguf_triton``: their fused Triton kernels (imported only on CUDA);
- ``slot_codecs``: the codecs the offload's decode stream runs into slot regions (packed bf16,
  GGUF dequantization);
- ``fp8_quant``: rowwise e4m3 quantization of weights and activations;
- ``fp8_linear``: ``FP8Linear``, plain fp8 weight + fp32 scale tensors, ``torch._scaled_mm``
  on CUDA and an emulated matmul elsewhere;
- ``fp8_select``: which linear layers of a DiT to quantize, and the swap itself.
"""
