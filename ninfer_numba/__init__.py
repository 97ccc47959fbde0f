"""ninfer_numba: Qwen3.5/3.6 dense hybrid inference from GGUF Q8_0, with GPU kernels in numba-cuda.

Public API: ``LLM``, ``SamplingParams``, ``open_model`` (load and validate a GGUF) and
``write_synthetic_gguf`` (random-weight models at the published shapes).
"""
from ninfer_numba.config import EngineConfig, ModelConfig, ModelFormatError, SamplingParams
from ninfer_numba.engine.llm import GenerationResult, LLM
from ninfer_numba.model.weights import open_model
from ninfer_numba.synth import write_synthetic_gguf

__all__ = ["LLM", "SamplingParams", "GenerationResult", "EngineConfig", "ModelConfig", "ModelFormatError",
           "open_model", "write_synthetic_gguf"]
__version__ = "0.1.0"
