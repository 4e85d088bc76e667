"""keel: a readable LLM inference engine on vLLM v1's persistent-batch architecture."""

import logging
import os

from keel.engine.llm import LLM
from keel.outputs import (
    CompletionOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from keel.pooling_params import PoolingParams
from keel.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EmbeddingRequestOutput", "PoolingParams",
           "PoolingRequestOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

# Like vLLM, keel prints its own start-up information (KV cache size, ...) unless told not to.
if os.environ.get("KEEL_CONFIGURE_LOGGING", "1") == "1":
    _logger = logging.getLogger("keel")
    if not _logger.handlers:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        _logger.addHandler(_handler)
        _logger.setLevel(logging.INFO)
        _logger.propagate = False
