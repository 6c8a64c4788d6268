"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's dynamic LoRA routes):
``routes``, registered only when the operator allows runtime updates.
"""
