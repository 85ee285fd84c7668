"""vllm-bi100-patch: a runtime shim that makes stock vLLM safe on Iluvatar BI-V100."""
