"""vLLM 0.6.3's own engines without a model: ``LLMEngine``, ``AsyncLLMEngine`` and ``LLM`` built
exactly as vLLM builds them (configs, tokenizer, input processing, scheduler, output processing,
detokenizer), around a stand-in executor that "samples" a fixed token for every scheduled
sequence.  Used by engine_probe.py and tool_stream_app.py.

The model is serving_app.py's (a tiny Llama ``config.json``, never loaded, and a byte-level
tokenizer).  What it cannot model: the model and the sampler; logits processors (guided
decoding) are built by the engine as always, never applied (guided_probe.py applies them).
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package
sys.path.insert(0, HERE)

from serving_app import build_model  # noqa: E402

_MODEL = {}


def model_path() -> str:
    """The tiny model's directory (built once per process)."""
    if "path" not in _MODEL:
        _MODEL["path"] = tempfile.mkdtemp(prefix="bi100-engine-")
        build_model(_MODEL["path"])
    return _MODEL["path"]


def executor_class(token_text: str = "a"):
    """A stand-in executor (``ExecutorAsyncBase``): every scheduled sequence that samples gets
    the token of ``token_text``."""
    from vllm.executor.executor_base import ExecutorAsyncBase
    from vllm.model_executor.layers.sampler import SamplerOutput
    from vllm.sequence import CompletionSequenceGroupOutput, Logprob, SequenceOutput
    from vllm.transformers_utils.tokenizer import get_tokenizer

    token = get_tokenizer(model_path()).encode(token_text, add_special_tokens=False)[0]

    class StandInExecutor(ExecutorAsyncBase):
        uses_ray = False

        def _init_executor(self):
            pass

        def determine_num_available_blocks(self):
            return 512, 0

        def initialize_cache(self, num_gpu_blocks, num_cpu_blocks):
            pass

        def execute_model(self, execute_model_req):
            outputs = []
            for md in execute_model_req.seq_group_metadata_list:
                samples = [SequenceOutput(sid, token, {token: Logprob(0.0)})
                           for sid in md.seq_data] if md.do_sample else []
                outputs.append(CompletionSequenceGroupOutput(samples, None))
            return [SamplerOutput(outputs=outputs)]

        async def execute_model_async(self, execute_model_req):
            return self.execute_model(execute_model_req)

        def add_lora(self, lora_request):
            return True

        def remove_lora(self, lora_id):
            return True

        def pin_lora(self, lora_id):
            return True

        def list_loras(self):
            return set()

        def add_prompt_adapter(self, prompt_adapter_request):
            return True

        def remove_prompt_adapter(self, prompt_adapter_id):
            return True

        def pin_prompt_adapter(self, prompt_adapter_id):
            return True

        def list_prompt_adapters(self):
            return set()

        def check_health(self):
            pass

    return StandInExecutor


def configs(max_num_seqs: int = 4, backend: str = "outlines"):
    """The positional configuration arguments of ``LLMEngine.__init__`` (model, cache, parallel,
    scheduler, device, load, lora, speculative, decoding, observability, prompt adapter)."""
    from vllm.config import (CacheConfig, DecodingConfig, DeviceConfig, LoadConfig, ModelConfig,
                             ObservabilityConfig, ParallelConfig, SchedulerConfig)

    path = model_path()
    model = ModelConfig(path, path, "auto", False, "float32", 0, max_model_len=512)
    model.use_async_output_proc = False  # the stand-in executor has no output callback
    return (model, CacheConfig(16, 0.9, 0, "auto"), ParallelConfig(1, 1, False),
            SchedulerConfig(512, max_num_seqs, 512), DeviceConfig("cpu"), LoadConfig(), None,
            None, DecodingConfig(guided_decoding_backend=backend), ObservabilityConfig(), None)


def llm_engine(max_num_seqs: int = 4, backend: str = "outlines"):
    from vllm.engine.llm_engine import LLMEngine

    return LLMEngine(*configs(max_num_seqs, backend), executor_class(), log_stats=False)


def async_engine(max_num_seqs: int = 4, backend: str = "outlines"):
    """An ``AsyncLLMEngine`` (its loop starts with its first request, in the running loop)."""
    from vllm.engine.async_llm_engine import AsyncLLMEngine

    return AsyncLLMEngine(*configs(max_num_seqs, backend), executor_class(), log_stats=False,
                          log_requests=False, start_engine_loop=True)


def llm(max_num_seqs: int = 4):
    """vLLM's ``LLM`` around ``llm_engine`` (what ``LLM.__init__`` sets, without loading)."""
    from vllm.entrypoints.llm import LLM
    from vllm.utils import Counter

    out = object.__new__(LLM)
    out.llm_engine = llm_engine(max_num_seqs)
    out.request_counter = Counter()
    return out
